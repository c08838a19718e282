"""tandem client SDK: chat with an LLM through a tandem edge daemon.

Needs only ``grpcio`` and ``protobuf``::

    from tandem import Client
    with Client("localhost:50061") as c:
        for delta in c.chat([{"role": "user", "content": "Hi"}], max_new_tokens=32):
            print(delta.text, end="")

``AsyncClient`` is the asyncio twin. See ``tandem.client``.
"""

from tandem.client import AsyncClient, ChatResult, Client, Delta, TandemClientError

__all__ = ["AsyncClient", "ChatResult", "Client", "Delta", "TandemClientError"]
