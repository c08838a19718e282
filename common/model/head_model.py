"""The edge head: embedding plus decoder layers [0, k) of a supported HF decoder, generated from
the HF model's own modules (its embedding with any scale, its rotary embedding, its decoder layers
with their attention, norms and soft-caps) so it exports to ONNX with explicit past/present KV.

Notation (used across tandem): ``Bt`` batch rows, ``T`` new tokens, ``P`` past tokens, ``H``
hidden size, ``Hq`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``L`` layers, ``B`` KV block size.

Nothing here re-implements a layer: ``EdgeHead`` runs the HF base model's own ``forward`` over
its first ``k`` layers (the final norm left out), with the attention masks built here (the only
part tandem owns: which key slots a query may see, ``attention_bias``) and a cache object that
takes the past KV as inputs and hands every layer's KV back as outputs (``ExplicitKV``). Keys are
cached as HF caches them, after RoPE (and after the q/k norms of Qwen3 and Gemma3), as vLLM caches
them, so head KV can be written into vLLM's paged cache unchanged. The families and how their
base model takes masks are in ``FAMILIES``; any other architecture is refused by name
(``UnsupportedArchitecture``).

This module does not run inference in production (ONNX Runtime does); it is the export source
and a torch reference for tests. ``common.model.prepare`` checks every export against HF before it
writes a bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tandem.common.model.head_io import io_names

__all__ = [
    "FAMILIES",
    "EdgeFull",
    "EdgeHead",
    "ExplicitKV",
    "Family",
    "UnsupportedArchitecture",
    "attention_bias",
    "family_of",
    "io_names",
]  # io_names: see common.model.head_io

MaskStyle = Literal["causal", "config_window", "by_layer_type"]


@dataclass(frozen=True)
class Family:
    """A supported decoder family: its HF architecture name and how its base model's ``forward``
    takes a prepared mask (read from ``transformers/models/<family>/modeling_<family>.py``):

    * ``causal``: one 4D mask, causal over all layers (Llama);
    * ``config_window``: one 4D mask, windowed by ``config.sliding_window`` when set, for every
      layer (Mistral, Phi3: ``create_sliding_window_causal_mask`` when it is set);
    * ``by_layer_type``: a dict ``{"full_attention": ..., "sliding_attention": ...}`` picked per
      layer by ``config.layer_types`` (Qwen2, Qwen3, Gemma2, Gemma3).
    """

    name: str  # the family as the docs' table names it
    architecture: str  # ``config.architectures[0]``
    masks: MaskStyle


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("Llama", "LlamaForCausalLM", "causal"),
        Family("Mistral", "MistralForCausalLM", "config_window"),
        Family("Qwen2", "Qwen2ForCausalLM", "by_layer_type"),
        Family("Qwen3", "Qwen3ForCausalLM", "by_layer_type"),
        Family("Gemma2", "Gemma2ForCausalLM", "by_layer_type"),
        Family("Gemma3", "Gemma3ForCausalLM", "by_layer_type"),
        Family("Phi3", "Phi3ForCausalLM", "config_window"),
    )
}


class UnsupportedArchitecture(ValueError):
    """A checkpoint of an architecture tandem cannot split; the message names it and the supported ones."""


def family_of(config: Any) -> Family:
    """The family of an HF config (``PretrainedConfig`` or the ``config.json`` dict).

    Raises:
        UnsupportedArchitecture: ``architectures`` is missing, lists several, or names one not in ``FAMILIES``.
    """
    archs = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    archs = list(archs or [])
    if len(archs) == 1 and archs[0] in FAMILIES:
        return FAMILIES[archs[0]]
    named = ", ".join(archs) or "none named in config.json"
    raise UnsupportedArchitecture(
        f"tandem cannot split architecture {named}; it splits {', '.join(sorted(FAMILIES))}. "
        "`tandem-model --direct-only` prepares it for direct mode (plain vLLM on the cloud)."
    )


def attention_bias(
    position_ids: torch.Tensor, attention_mask: torch.Tensor, window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask ``[Bt, 1, T, P+T]`` (0 allowed, dtype's min refused) for eager attention.

    A query at new-token index ``i`` may attend key slot ``j`` iff ``attention_mask[j] == 1`` and
    ``j <= P + i`` (causal over the slot order) and, with a ``window``, the key's position is
    within ``window`` of the query's: ``pos_q - pos_k < window`` (HF's ``sliding_window_overlay``,
    vLLM's sliding window). A key's position is the count of real slots before it in its row
    (``cumsum(attention_mask) - 1``), so padding slots take no position.

    Args:
        position_ids: int64 ``[Bt, T]``, absolute positions of the new tokens.
        attention_mask: int64 ``[Bt, P+T]``, 1 where a key slot holds a real token.
    """
    t = position_ids.shape[1]
    total = attention_mask.shape[1]
    q_slot = torch.arange(t, device=position_ids.device).unsqueeze(1) + (total - t)  # [T, 1]
    k_slot = torch.arange(total, device=position_ids.device).unsqueeze(0)  # [1, P+T]
    allowed = (k_slot <= q_slot).unsqueeze(0) & (attention_mask.unsqueeze(1) > 0)  # [Bt, T, P+T]
    if window is not None:
        k_pos = torch.cumsum(attention_mask, dim=-1) - 1  # [Bt, P+T]
        allowed = allowed & (position_ids.unsqueeze(2) - k_pos.unsqueeze(1) < window)
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype)).unsqueeze(1)


class ExplicitKV:
    """The cache object handed to the HF layers: layer ``i``'s ``update`` appends the new KV to
    ``past[i]`` and keeps the result as ``present[i]`` (an HF ``Cache`` in the calls the layers
    make: ``update`` and ``get_seq_length``).

    ``past``: ``[(key, value)]`` per layer, float32 ``[Bt, Hkv, P, D]``.
    """

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states`` / ``value_states``: ``[Bt, Hkv, T, D]``; returns ``[Bt, Hkv, P+T, D]``."""
        past_k, past_v = self.past[layer_idx]
        k = torch.cat([past_k, key_states], dim=2)
        v = torch.cat([past_v, value_states], dim=2)
        self.present[layer_idx] = (k, v)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past[layer_idx][0].shape[2]

    def presents(self) -> list[torch.Tensor]:
        """``present_key_0, present_value_0, ...`` in layer order.

        Raises:
            RuntimeError: a layer did not write its KV (its attention took no cache).
        """
        if any(p is None for p in self.present):
            raise RuntimeError("a decoder layer did not update the cache: its attention is not supported")
        return [t for p in self.present if p is not None for t in p]


def _masks(
    family: Family, config: Any, position_ids: torch.Tensor, attention_mask: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The prepared mask(s) the family's base ``forward`` takes (see ``Family``)."""
    window = getattr(config, "sliding_window", None)
    if family.masks == "causal":
        return attention_bias(position_ids, attention_mask, None, dtype)
    if family.masks == "config_window":
        return attention_bias(position_ids, attention_mask, window, dtype)
    return {
        "full_attention": attention_bias(position_ids, attention_mask, None, dtype),
        "sliding_attention": attention_bias(position_ids, attention_mask, window, dtype),
    }


class _Layers(nn.Module):
    """Embedding + the first ``n`` decoder layers of an HF causal LM, through its base model's own
    ``forward`` (the final norm replaced by identity). Takes the HF model over: its base model's
    layer list and norm are changed in place (load a model for each export)."""

    def __init__(self, hf_model: Any, n: int) -> None:
        super().__init__()
        cfg = hf_model.config
        self.family = family_of(cfg)
        if not 1 <= n <= cfg.num_hidden_layers:
            raise ValueError(f"split layer k={n} outside [1, {cfg.num_hidden_layers}]")
        if cfg._attn_implementation != "eager":
            raise ValueError(f"load the model with attn_implementation='eager', not {cfg._attn_implementation!r}")
        self.n = n
        self.config = cfg
        self.base = hf_model.model
        self.base.layers = nn.ModuleList(list(self.base.layers)[:n])

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if len(past) != 2 * self.n:
            raise ValueError(f"expected {2 * self.n} past tensors, got {len(past)}")
        cache = ExplicitKV([(past[2 * i], past[2 * i + 1]) for i in range(self.n)])
        dtype = self.base.embed_tokens.weight.dtype
        masks = _masks(self.family, self.config, position_ids, attention_mask, dtype)
        out = self.base(
            input_ids=input_ids,
            attention_mask=masks,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state, cache.presents()


class EdgeHead(nn.Module):
    """Embedding + layers [0, k) of a supported HF causal LM (``FAMILIES``), loaded with
    ``attn_implementation="eager"``; takes the model over (see ``_Layers``).

    Inputs:
        input_ids: int64 [Bt, T]
        position_ids: int64 [Bt, T], absolute positions (past length + i for row-local tokens)
        attention_mask: int64 [Bt, P+T], 1 where a key slot holds a real token
        past_key_i / past_value_i: float32 [Bt, Hkv, P, D] for i in [0, k)
    Outputs:
        hidden: float32 [Bt, T, H], the residual stream entering layer k (HF ``hidden_states[k]``)
        present_key_i / present_value_i: float32 [Bt, Hkv, P+T, D], keys post-RoPE

    Masking: ``attention_bias``. Padding rows produce garbage outputs that callers discard.

    Raises:
        UnsupportedArchitecture: the model's architecture is not in ``FAMILIES``.
        ValueError: ``k`` outside ``[1, L]``, or the model not loaded with eager attention.
    """

    def __init__(self, hf_model: Any, k: int) -> None:
        super().__init__()
        self.k = k
        self.body = _Layers(hf_model, k)
        self.body.base.norm = nn.Identity()

    def forward(self, input_ids, position_ids, attention_mask, *past: torch.Tensor):
        hidden, presents = self.body(input_ids, position_ids, attention_mask, *past)
        return (hidden, *presents)


class EdgeFull(nn.Module):
    """The whole model for edge-only inference: all ``L`` layers, the final norm, ``lm_head`` and
    any final logit soft-cap (the HF causal LM's own ``forward`` with ``logits_to_keep=1``).

    Inputs as ``EdgeHead`` (``k = L``); outputs ``logits`` float32 ``[Bt, V]`` of the last
    new token of each row (rows must not be right-padded), then ``present_*`` as ``EdgeHead``.
    """

    def __init__(self, hf_model: Any) -> None:
        super().__init__()
        self.n = hf_model.config.num_hidden_layers
        self.family = family_of(hf_model.config)
        if hf_model.config._attn_implementation != "eager":
            raise ValueError("load the model with attn_implementation='eager'")
        self.model = hf_model

    def forward(self, input_ids, position_ids, attention_mask, *past: torch.Tensor):
        if len(past) != 2 * self.n:
            raise ValueError(f"expected {2 * self.n} past tensors, got {len(past)}")
        cache = ExplicitKV([(past[2 * i], past[2 * i + 1]) for i in range(self.n)])
        dtype = self.model.model.embed_tokens.weight.dtype
        masks = _masks(self.family, self.model.config, position_ids, attention_mask, dtype)
        out = self.model(
            input_ids=input_ids,
            attention_mask=masks,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return (out.logits[:, -1], *cache.presents())


class Float16Compute(nn.Module):
    """``inner`` (an ``EdgeHead`` or ``EdgeFull``) with float16 weights and arithmetic behind its
    float32 interface: the past KV inputs are cast to float16 on entry and every output back to
    float32, so the graph's inputs and outputs (and the wire, the block store and the KV layout
    after it) are those of the float32 export. What HF computes in float32 inside a half-precision
    model stays float32: the RMSNorm variance and the attention softmax (HF casts there) and the
    rotary embedding, whose inverse frequencies are kept float32 here (``module.half()`` would round
    them to 11 bits: an angle error of radians at a few thousand positions).

    Takes ``inner`` over (its parameters become float16).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        keep = {name: buf.detach().clone() for name, buf in inner.named_buffers() if name.endswith("inv_freq")}
        self.inner = inner.half()
        for name, buf in keep.items():
            owner, _, attr = name.rpartition(".")
            setattr(self.inner.get_submodule(owner) if owner else self.inner, attr, buf)

    def forward(self, input_ids, position_ids, attention_mask, *past: torch.Tensor):
        out = self.inner(input_ids, position_ids, attention_mask, *(p.half() for p in past))
        return tuple(o.float() for o in out)
