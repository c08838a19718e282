"""tandem client SDK: chat with an LLM through a tandem edge daemon.

Needs only ``grpcio`` and ``protobuf``::

    from tandem import Client
    with Client("localhost:50061") as c:
        for delta in c.chat([{"role": "user", "content": "Hi"}], max_new_tokens=32):
            print(delta.text, end="")

``AsyncClient`` is the asyncio twin. See ``tandem.client``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

from tandem.client import AsyncClient, ChatResult, Client, Delta, TandemClientError  # noqa: E402

__all__ = ["AsyncClient", "ChatResult", "Client", "Delta", "TandemClientError", "__version__"]
