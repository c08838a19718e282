"""The serving modes of a chat turn (``tandem.v1.Mode``) as one domain enum, and its conversions.

``AUTO`` lets the edge pick a mode per request (``edge.routing.router``); ``LOCAL`` runs the whole model
on the edge, ``SPLIT`` the head on the edge and the tail and decode in the cloud, ``DIRECT`` sends
token ids up and the cloud runs every layer, ``REMOTE_PREFILL`` sends token ids up, the cloud
prefills and streams the first tokens while the prompt's KV comes down, and the edge decodes the
rest with its whole model (vLLM's disaggregation names the prefill side "remote prefill"). A
member's value is the name every API uses for it (``ChatDone.mode``, ``EdgeInfo.modes``, metric
labels, log fields, the OpenAI API's ``mode``), so a member formats and compares as that name.
Conversion only: no choice of a mode here.
"""

from __future__ import annotations

import enum

from tandem.common.protocol.errors import InvalidRequest
from tandem.v1 import tandem_pb2 as pb


class Mode(enum.StrEnum):
    AUTO = "auto"
    LOCAL = "local"
    SPLIT = "split"
    DIRECT = "direct"
    REMOTE_PREFILL = "remote_prefill"

    @classmethod
    def from_pb(cls, value: int) -> Mode:
        """The mode of a ``tandem.v1.Mode`` value (``MODE_UNSPECIFIED`` is ``AUTO``).

        Raises:
            InvalidRequest: a value the proto does not define.
        """
        try:
            return _FROM_PB[value]
        except KeyError:
            raise InvalidRequest(f"unknown mode {value}", param="mode") from None

    def to_pb(self) -> int:
        """The ``tandem.v1.Mode`` value (``AUTO`` is ``MODE_AUTO``)."""
        return _TO_PB[self]

    @classmethod
    def from_name(cls, name: str) -> Mode:
        """The mode named ``name`` (``"auto"``, ``"local"``, ``"split"``, ``"direct"``, ``"remote_prefill"``).

        Raises:
            InvalidRequest: any other name.
        """
        try:
            return cls(name)
        except ValueError:
            raise InvalidRequest(f"mode must be one of {[m.value for m in cls]}, got {name!r}", param="mode") from None


_TO_PB: dict[Mode, int] = {
    Mode.AUTO: pb.MODE_AUTO,
    Mode.LOCAL: pb.MODE_LOCAL,
    Mode.SPLIT: pb.MODE_SPLIT,
    Mode.DIRECT: pb.MODE_DIRECT,
    Mode.REMOTE_PREFILL: pb.MODE_REMOTE_PREFILL,
}
_FROM_PB: dict[int, Mode] = {pb.MODE_UNSPECIFIED: Mode.AUTO, **{v: m for m, v in _TO_PB.items()}}
