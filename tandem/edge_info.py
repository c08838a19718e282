"""What an edge serves and its limits (``Edge.GetInfo``) as ``EdgeInfo``, whose ``check(...)`` refuses a
request the edge would refuse, before it is sent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.chat_request import (
    _MODES,
    _stop_strings,
    _stop_token_ids,
)
from tandem.pbconv import from_pb
from tandem.v1 import tandem_pb2 as pb


@dataclass(frozen=True)
class EdgeInfo:
    """What an edge serves and its limits (``Client.info()``; units in names). A limit of 0 means
    the edge did not say (an older edge): ``check`` does not check it.

    Attributes:
        model_id: the model the edge serves.
        split_layer: the deepest split layer ``k`` usable now; 0 = none (local or direct only).
        max_prompt_tokens: the longest prompt (after the chat template) the edge accepts, in tokens.
        max_new_tokens: the largest ``max_new_tokens`` a turn may ask for.
        max_stop_strings: the most ``stop`` strings a turn may name.
        max_stop_token_ids: the most ``stop_token_ids`` a turn may name.
        default_timeout_s: the deadline the edge gives a turn whose client set none, in seconds.
        version: the edge's tandem version.
        modes: the modes servable now (``"local"``, ``"split"``, ``"direct"``, ``"remote_prefill"``).
        split_layers: every split layer usable now (the edge holds the head, the cloud the tail).
        cloud_connected: whether the edge's link to the cloud is up.
        degraded: why not every mode the edge was built for is available ("" = all are).
    """

    model_id: str
    split_layer: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_stop_strings: int
    max_stop_token_ids: int
    default_timeout_s: float
    version: str
    modes: tuple[str, ...] = ()
    split_layers: tuple[int, ...] = ()
    cloud_connected: bool = False
    degraded: str = ""

    @classmethod
    def from_pb(cls, m: pb.EdgeInfo) -> EdgeInfo:
        return from_pb(cls, m)

    def problems(
        self,
        *,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
        mode: str | None = None,
    ) -> list[str]:
        """What in a request this edge would refuse (empty: nothing); arguments as ``check``."""
        out: list[str] = []
        lim = (
            ("max_new_tokens", max_new_tokens, self.max_new_tokens),
            ("prompt tokens", prompt_tokens, self.max_prompt_tokens),
            ("stop strings", None if stop is None else len(_stop_strings(stop)), self.max_stop_strings),
            ("stop token ids", None if stop_token_ids is None else len(_stop_token_ids(stop_token_ids)),
             self.max_stop_token_ids),
        )  # fmt: skip
        for what, n, most in lim:
            if n is not None and most and n > most:
                out.append(f"{what}: {n} > {most}, this edge's limit")
        if mode in _MODES and mode != "auto" and self.modes and mode not in self.modes:
            out.append(f"mode {mode!r}: this edge serves {list(self.modes)} now ({self.degraded or 'by design'})")
        return out

    def check(
        self,
        *,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
        mode: str | None = None,
    ) -> None:
        """Check a request against this edge's limits before sending it: the same values as
        ``chat``'s arguments (``prompt_tokens``: the prompt's length in tokens, if the app knows
        it); ``None`` skips a value. For example::

            info = client.info()
            info.check(max_new_tokens=n, stop=stops)  # before client.chat(..., max_new_tokens=n, stop=stops)

        Raises:
            ValueError: naming every limit the request exceeds (the edge would answer
                ``InvalidArgument``), or an invalid stop string or id.
        """
        p = self.problems(
            max_new_tokens=max_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            prompt_tokens=prompt_tokens,
            mode=mode,
        )
        if p:
            raise ValueError("; ".join(p))
