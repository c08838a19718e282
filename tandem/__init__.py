"""tandem client SDK: chat with an LLM through a tandem edge daemon.

Needs only ``grpcio`` and ``protobuf``::

    from tandem import Client
    with Client("localhost:50061") as c:  # each call's deadline: 300 s unless timeout_s= says otherwise
        print(c.info().max_new_tokens)  # the edge's limits
        for delta in c.chat([{"role": "user", "content": "Hi"}], max_new_tokens=32, stop=["\\n\\n"]):
            print(delta.text, end="")

``AsyncClient`` is the asyncio twin. A failed call raises one ``TandemClientError`` subclass per
gRPC status (``InvalidArgument``, ``Unavailable``, ``ResourceExhausted``, ...; see
``tandem.errors``). See ``tandem.client`` and ``Client.chat`` for every parameter.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

from tandem.client import (  # noqa: E402
    DEFAULT_TIMEOUT_S,
    AsyncChatStream,
    AsyncClient,
    ChatResult,
    ChatStream,
    Client,
    Delta,
    EdgeInfo,
)
from tandem.errors import (  # noqa: E402
    Aborted,
    AlreadyExists,
    BadArgument,
    BadArgumentType,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    TandemClientError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Aborted",
    "AlreadyExists",
    "AsyncChatStream",
    "AsyncClient",
    "BadArgument",
    "BadArgumentType",
    "Cancelled",
    "ChatResult",
    "ChatStream",
    "Client",
    "DataLoss",
    "DeadlineExceeded",
    "Delta",
    "EdgeInfo",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "TandemClientError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "__version__",
]
