"""Behaviour switches: where a checkpoint's computation changes with a sequence's length or with the
layer, what HF (the reference, and the source of the edge's ONNX graphs) and the pinned vLLM (the
cloud's engines, 0.32) each do there, and how tandem makes them compute one function
(``plan``) or refuses the checkpoint with a one-line reason (``Unservable``).

One table per kind of switch: rope scaling (``ROPE_TYPES``), sliding windows per layer (HF's rule
is the family's mask style, ``head_model.Family.masks``; vLLM's is ``VLLM_WINDOWS``, read from its
model files), and config fields a family's vLLM model ignores (``VLLM_IGNORED``). What each switch
does on each side and tandem's answer (export overrides, ``hf_overrides``, a bounded
``max_model_len``, a refusal): docs/models.md, "Behaviour switches".

The plan also names the longest sequence the preparation check must run (``check_tokens``: past
every switch the deployment can reach). Nothing here loads weights or vLLM; ``common.model.prepare``
calls ``plan`` before it exports anything, the cloud checks its ``max_model_len`` against the
manifest's ``EngineAgreement`` before its engines start.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tandem.common.protocol.manifest import EngineAgreement

if TYPE_CHECKING:
    from tandem.common.model.head_model import Family

__all__ = [
    "CHECK_PAST_SWITCH_TOKENS",
    "ROPE_TYPES",
    "VLLM_IGNORED",
    "VLLM_WINDOWS",
    "Unservable",
    "hf_windows",
    "check_tail",
    "plan",
    "tail_config",
    "vllm_windows",
]

CHECK_PAST_SWITCH_TOKENS = 8  # the check's longest row runs this many tokens past the last switch it reaches
SLIDING = "sliding_attention"


class Unservable(ValueError):
    """A checkpoint (or a ``max_model_len``) for which the edge's graphs and the pinned vLLM cannot
    compute one function; the message is one line naming the field and the reason."""


# ---- rope scaling --------------------------------------------------------------------------------

RopeKind = Literal["static", "length_switch", "refused"]


@dataclass(frozen=True)
class RopeType:
    """How HF and vLLM treat one ``rope_type``: ``static`` (one function of the position on both
    sides), ``length_switch`` (``longrope``: HF switches per call, vLLM per deployment) or ``refused``
    (with ``reason``); ``vllm_positions``: the rows of vLLM's cos/sin table, when fewer than the
    model's positions (yarn's: ``original_max_position_embeddings * factor``)."""

    kind: RopeKind
    reason: str = ""
    vllm_positions: Callable[[dict[str, Any]], int | None] | None = None


def _yarn_positions(rp: dict[str, Any]) -> int | None:
    orig, factor = rp.get("original_max_position_embeddings"), rp.get("factor")
    return int(orig * factor) if orig and factor else None


ROPE_TYPES: dict[str, RopeType] = {
    "default": RopeType("static"),
    "linear": RopeType("static"),
    "llama3": RopeType("static"),
    "yarn": RopeType("static", vllm_positions=_yarn_positions),
    "longrope": RopeType("length_switch"),
    "dynamic": RopeType(
        "refused",
        "HF rescales a dynamic rope with each sequence's length and vLLM at one fixed length, "
        "so no exported graph computes what vLLM does",
    ),
}


def _rope_parameter_sets(cfg: Any) -> list[dict[str, Any]]:
    """The rope parameter dicts of ``cfg`` (one, or one per layer type as in Gemma3)."""
    rp = getattr(cfg, "rope_parameters", None) or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):
        return list(rp.values())
    return [rp] if rp else []


def _longrope_mscales(cfg: Any, rp: dict[str, Any]) -> tuple[float, float, float]:
    """(HF's attention factor, vLLM's short and long mscale) of a longrope config."""
    orig = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or cfg.max_position_embeddings / orig
    hf = rp.get("attention_factor")
    if hf is None:
        hf = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    scale = cfg.max_position_embeddings / orig  # vLLM ignores ``factor`` and ``attention_factor``
    default = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
    return float(hf), float(rp.get("short_mscale") or default), float(rp.get("long_mscale") or default)


@dataclass(frozen=True)
class _RopePlan:
    export_rope: dict[str, Any] | None  # rope_parameters HF is exported and checked with (None: the checkpoint's)
    min_len: int  # the lowest max_model_len the choice holds for
    max_len: int | None  # the highest (None: no bound from the rope)
    switch_position: int | None  # the position the check must pass (None: no length switch reached)
    note: str


def _rope_plan(arch: str, cfg: Any, max_model_len: int) -> _RopePlan:
    """The rope choice for a deployment of ``max_model_len``.

    Raises:
        Unservable: a refused or unknown rope type, a per-layer-type longrope, or a longrope whose
            attention factor HF and vLLM compute differently.
    """
    sets = _rope_parameter_sets(cfg)
    table = None  # the fewest rows of a vLLM rope table
    for rp in sets:
        name = rp.get("rope_type") or rp.get("type") or "default"
        rule = ROPE_TYPES.get(name)
        if rule is None:
            raise Unservable(
                f"{arch} uses rope_type {name!r}, which tandem has not checked HF and vLLM to compute alike "
                f"(it knows {', '.join(sorted(ROPE_TYPES))})"
            )
        if rule.kind == "refused":
            raise Unservable(f"{arch} uses rope_type {name!r}: {rule.reason}")
        rows = rule.vllm_positions(rp) if rule.vllm_positions else None
        if rows is not None and rows < cfg.max_position_embeddings:
            if max_model_len > rows:
                raise Unservable(
                    f"{arch}'s {name} rope: vLLM computes it for {rows} positions (original_max_position_embeddings "
                    f"x factor), fewer than max_model_len {max_model_len}"
                )
            table = rows if table is None else min(table, rows)
    longs = [rp for rp in sets if (rp.get("rope_type") or rp.get("type")) == "longrope"]
    if not longs:
        note = f"rope: vLLM's table holds {table} positions (max_model_len up to {table})" if table else ""
        return _RopePlan(None, 2, table, None, note)
    if len(sets) != 1:
        raise Unservable(f"{arch} uses longrope per layer type, which tandem does not export")
    rp = longs[0]
    orig = int(rp["original_max_position_embeddings"])
    hf_factor, short_mscale, long_mscale = _longrope_mscales(cfg, rp)
    long = max_model_len > orig
    vllm_factor = long_mscale if long else short_mscale
    if not math.isclose(hf_factor, vllm_factor, rel_tol=1e-6):
        raise Unservable(
            f"{arch}'s longrope attention factor is {hf_factor:.6g} in HF and {vllm_factor:.6g} in vLLM "
            "(vLLM derives it from max_position_embeddings / original_max_position_embeddings and its mscales, "
            "HF from factor and attention_factor)"
        )
    if long:
        export = {**rp, "short_factor": list(rp["long_factor"])}
        note = (
            f"longrope: max_model_len {max_model_len} > original_max_position_embeddings {orig}, so vLLM uses the "
            f"long factors at every position; the graphs are exported and checked with them (max_model_len {orig + 1} "
            f"and above)"
        )
        return _RopePlan(export, orig + 1, None, orig, note)
    note = (
        f"longrope: max_model_len {max_model_len} <= original_max_position_embeddings {orig}: the short factors at "
        f"every position, on both sides (max_model_len up to {orig})"
    )
    return _RopePlan(None, 2, orig, None, note)


# ---- sliding windows -----------------------------------------------------------------------------

VllmWindowRule = Literal["per_layer_type", "uniform_only"]

# How the pinned vLLM's model of each family places sliding windows (``vllm/model_executor/models``):
# ``per_layer_type``: a layer whose ``layer_types`` entry is sliding gets ``sliding_window``, any other
# layer the model-wide window (``sliding_window`` when ``layer_types`` is absent or all sliding, else
# none) -- Llama (and Phi3, Mistral on it), Gemma2, Gemma3; ``uniform_only``: the model-wide window on
# every layer, and an assertion (the engine does not start) when ``layer_types`` mixes kinds -- Qwen2,
# Qwen3 (on Qwen2's model)
VLLM_WINDOWS: dict[str, VllmWindowRule] = {
    "LlamaForCausalLM": "per_layer_type",
    "MistralForCausalLM": "per_layer_type",
    "Phi3ForCausalLM": "per_layer_type",
    "Gemma2ForCausalLM": "per_layer_type",
    "Gemma3ForCausalLM": "per_layer_type",
    "Qwen2ForCausalLM": "uniform_only",
    "Qwen3ForCausalLM": "uniform_only",
}


def _window(cfg: Any) -> int | None:
    w = getattr(cfg, "sliding_window", None)
    return int(w) if w else None  # vLLM reads 0 as no window


def hf_windows(family: Family, cfg: Any) -> list[int | None]:
    """Each layer's sliding window in HF (and in the edge's graphs: ``head_model._masks``), None
    for full attention."""
    n, w = cfg.num_hidden_layers, _window(cfg)
    if family.masks == "causal":
        return [None] * n
    if family.masks == "config_window":
        return [w] * n
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    return [w if t == SLIDING else None for t in types]


def vllm_windows(arch: str, cfg: Any) -> list[int | None]:
    """Each layer's sliding window in the pinned vLLM's model of ``arch``.

    Raises:
        Unservable: vLLM does not start the model (Qwen2/Qwen3 with windows on some layers only).
    """
    n, w = cfg.num_hidden_layers, _window(cfg)
    types = getattr(cfg, "layer_types", None)
    model_wide = w if types is None or all(t == SLIDING for t in types) else None
    if VLLM_WINDOWS[arch] == "uniform_only":
        if types is not None and len(set(types)) > 1:
            sliding = sum(t == SLIDING for t in types)
            raise Unservable(
                f"{arch} slides a window of {w} tokens on {sliding} of its {n} layers (use_sliding_window, "
                f"max_window_layers {getattr(cfg, 'max_window_layers', '?')}): vLLM 0.32's model of it applies a "
                "window to every layer or to none and does not start this one"
            )
        return [model_wide] * n
    return [w if types is not None and types[i] == SLIDING else model_wide for i in range(n)]


# the overrides tried, in order, to make vLLM's windows HF's (``hf_overrides`` of its engines)
_WINDOW_OVERRIDES: tuple[dict[str, Any], ...] = ({"sliding_window": None},)


def _with(cfg: Any, overrides: dict[str, Any]) -> Any:
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        setattr(out, key, value)
    return out


def _describe(windows: list[int | None]) -> str:
    slid = [i for i, w in enumerate(windows) if w]
    if not slid:
        return "no window"
    sizes = sorted({w for w in windows if w})
    where = "every layer" if len(slid) == len(windows) else f"layers {slid}"
    return f"a window of {'/'.join(map(str, sizes))} tokens on {where}"


def _window_overrides(arch: str, family: Family, cfg: Any) -> tuple[dict[str, Any], str]:
    """The ``hf_overrides`` that make vLLM's windows HF's ({} when they agree) and a note.

    Raises:
        Unservable: vLLM cannot start the model, or no override makes it agree.
    """
    want = hf_windows(family, cfg)
    got = vllm_windows(arch, cfg)
    if got == want:
        return {}, (f"sliding window: {_describe(want)} in HF and vLLM" if any(want) else "")
    for overrides in _WINDOW_OVERRIDES:
        if vllm_windows(arch, _with(cfg, overrides)) == want:
            return overrides, (
                f"sliding window: HF's {family.name} applies {_describe(want)}, vLLM would apply {_describe(got)}; "
                f"vLLM is started with {overrides}"
            )
    raise Unservable(f"{arch}: HF applies {_describe(want)} and vLLM 0.32 {_describe(got)}")


# ---- fields vLLM ignores -------------------------------------------------------------------------

# per architecture: (config field, the value vLLM's model assumes instead of reading it)
VLLM_IGNORED: dict[str, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    "Qwen2ForCausalLM": (("head_dim", lambda c: c.hidden_size // c.num_attention_heads),),
}


def _ignored_fields(arch: str, cfg: Any) -> None:
    """Raises ``Unservable`` when a field the family's vLLM model ignores holds another value than
    the one it assumes."""
    for field, assumed in VLLM_IGNORED.get(arch, ()):
        value = getattr(cfg, field, None)
        if value is not None and value != assumed(cfg):
            raise Unservable(
                f"{arch} sets {field} {value}, but vLLM 0.32's model of it ignores {field} and uses {assumed(cfg)} "
                "(hidden_size / num_attention_heads)"
            )


# ---- the plan ------------------------------------------------------------------------------------


def plan(cfg: Any, max_model_len: int) -> EngineAgreement:
    """How the edge's graphs and the cloud's engines compute one function for a deployment whose
    engines run ``max_model_len`` tokens, for the transformers config ``cfg`` of a supported family
    (as both HF and vLLM read it: ``AutoConfig.from_pretrained``).

    Raises:
        UnsupportedArchitecture: not a supported family.
        Unservable: no such plan (one line: the field and why); ``max_model_len`` below 2 or beyond
            the model's ``max_position_embeddings``.
    """
    from tandem.common.model.head_model import family_of  # torch: imported when a plan is made

    family = family_of(cfg)
    arch = family.architecture
    max_pos = int(cfg.max_position_embeddings)
    if not 2 <= max_model_len <= max_pos:
        raise Unservable(f"max_model_len {max_model_len} is outside [2, {max_pos}] ({arch}'s max_position_embeddings)")
    _ignored_fields(arch, cfg)
    rope = _rope_plan(arch, cfg, max_model_len)
    hf_overrides, window_note = _window_overrides(arch, family, cfg)
    windows = {w for w in hf_windows(family, cfg) if w}
    # a switch acts first at its position p (a window w: the query at w no longer sees position 0);
    # max_model_len <= p never reaches it, so one the check does not pass bounds max_model_len
    switches = windows | ({rope.switch_position} if rope.switch_position else set())
    reached = {p for p in switches if p < max_model_len}
    unreached = [p for p in switches if p >= max_model_len]
    highest = min([max_pos, *unreached, *([rope.max_len] if rope.max_len else [])])
    check_tokens = min(max_model_len, max(reached) + CHECK_PAST_SWITCH_TOKENS) if reached else 0
    return EngineAgreement(
        max_model_len_min_tokens=rope.min_len,
        max_model_len_max_tokens=highest,
        hf_overrides=hf_overrides,
        export_overrides={"rope_parameters": rope.export_rope} if rope.export_rope else {},
        notes=tuple(n for n in (rope.note, window_note) if n),
        check_tokens=check_tokens,
    )


def tail_config(cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """The ``config.json`` of the tail of layers ``[k, L)`` renumbered from 0: the layer count less
    ``k``, per-layer lists (``layer_types``) cut at ``k``, and ``max_window_layers`` (layers below it
    attend fully in Qwen2/Qwen3) moved down by ``k``, so each tail layer keeps its global layer's
    attention whichever of the two fields a reader derives it from."""
    out = dict(cfg)
    out["num_hidden_layers"] = cfg["num_hidden_layers"] - k
    if isinstance(cfg.get("layer_types"), list):
        out["layer_types"] = cfg["layer_types"][k:]
    if isinstance(cfg.get("max_window_layers"), int):
        out["max_window_layers"] = max(0, cfg["max_window_layers"] - k)
    return out


def check_tail(cfg: Any, tail_cfg: Any, k: int, hf_overrides: dict[str, Any]) -> None:
    """That vLLM, started with ``hf_overrides`` on the tail checkpoint's config ``tail_cfg`` (layers
    ``[k, L)``), places each layer's window as HF does on global layer ``i + k`` of ``cfg``.

    Raises:
        Unservable: a tail layer's window differs (one line, both lists).
    """
    from tandem.common.model.head_model import family_of

    family = family_of(cfg)
    want = hf_windows(family, cfg)[k:]
    got = vllm_windows(family.architecture, _with(tail_cfg, hf_overrides))
    if got != want:
        raise Unservable(f"the tail at k={k} would slide windows {got} in vLLM where HF slides {want}")
