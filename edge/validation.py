"""The edge's one verdict on a request, reached before it chooses a route.

A request is valid or not whatever mode serves it: ``check_turn`` runs once per turn, after
tokenizing and before routing (``edge.node``), against ``edge_limits``: the edge's own bounds
(its config and the model's shape), the whole model's when local mode is loaded and the cloud's
as last negotiated (``LinkParams``: they stay known while the link is down), each narrowing the
others. Every mode's own check (``edge.compute.local.LocalEngine.validate``, ``cloud.uploads.upload.check_header``)
is ``RequestLimits.check`` under limits at least as wide, so what passes here passes there, and
what fails here fails with the message and status that mode would give. Pure domain code.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tandem.common.protocol.errors import ModeUnavailable
from tandem.common.protocol.limits import RequestLimits, check_session_id, check_split_layer_range
from tandem.common.protocol.params import LinkParams
from tandem.edge.events import ChatTurn, check_split_layer


def cloud_limits(p: LinkParams | None) -> RequestLimits:
    """What a cloud that negotiated ``p`` (its direct-mode params; None: never negotiated) accepts."""
    if p is None:
        return RequestLimits()
    return RequestLimits(
        vocab_size=p.vocab_size,
        max_prompt_tokens=p.max_prompt_tokens,
        max_new_tokens=p.max_new_tokens,
        max_model_len_tokens=p.max_model_len_tokens,
    )


def edge_limits(own: RequestLimits, local: RequestLimits | None, cloud: RequestLimits) -> RequestLimits:
    """The limits every mode of this edge accepts: its own narrowed by local mode's (when loaded)
    and the cloud's (when ever negotiated)."""
    out = own.narrowed(cloud)
    return out.narrowed(local) if local is not None else out


def check_turn(request: ChatTurn, ids: Sequence[int], limits: RequestLimits, head_layers: Collection[int]) -> None:
    """The verdict on ``request`` (prompt token ids ``ids``) in every mode.

    Raises:
        InvalidRequest: a session id too long for the cloud, ``split_layer`` outside ``[0, 2**32)``
            or with a mode other than split, or what ``RequestLimits.check`` refuses (the prompt's
            field: ``messages`` for a chat, else ``prompt``).
        ModeUnavailable: ``split_layer`` names a split this edge holds no head for (``param``
            ``split_layer``).
    """
    check_session_id(request.session_id)
    k = request.split_layer
    check_split_layer_range(k)
    check_split_layer(k, request.mode)
    if k and k not in head_layers:
        raise ModeUnavailable(f"this edge holds heads for k in {sorted(head_layers)}, not k={k}", param="split_layer")
    limits.check(ids, request.sampling, "messages" if request.messages else "prompt")
