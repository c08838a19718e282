"""The edge head: embedding plus decoder layers [0, k) of a Llama-family model,
written as a plain torch module over the HF weights so it exports to ONNX with
explicit past/present KV.

Notation (used across tandem): ``Bt`` batch rows, ``T`` new tokens, ``P`` past
tokens, ``H`` hidden size, ``Hq`` query heads, ``Hkv`` KV heads, ``D`` head dim,
``L`` layers, ``B`` KV block size.

Keys are cached *after* RoPE, as vLLM caches them, so head KV can be written
into vLLM's paged cache unchanged.

This module does not run inference in production (ONNX Runtime does); it is the
export source and a torch reference for tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.common.head_io import io_names

__all__ = ["EdgeFull", "EdgeHead", "HeadAttention", "HeadLayer", "io_names"]  # io_names: see common.head_io


class HeadAttention(nn.Module):
    """GQA self-attention with explicit past KV (post-RoPE keys)."""

    def __init__(self, hf_attn: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj: Any = hf_attn.q_proj
        self.k_proj: Any = hf_attn.k_proj
        self.v_proj: Any = hf_attn.v_proj
        self.o_proj: Any = hf_attn.o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [Bt, T, H]
        cos: torch.Tensor,  # [Bt, T, D]
        sin: torch.Tensor,  # [Bt, T, D]
        bias: torch.Tensor,  # [Bt, 1, T, P+T] additive mask, 0 or -inf-like
        past_k: torch.Tensor,  # [Bt, Hkv, P, D]
        past_v: torch.Tensor,  # [Bt, Hkv, P, D]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        bt, t, _ = x.shape
        q = self.q_proj(x).view(bt, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bt, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bt, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_all = torch.cat([past_k, k], dim=2)  # [Bt, Hkv, P+T, D]
        v_all = torch.cat([past_v, v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        k_rep = k_all.repeat_interleave(groups, dim=1)  # [Bt, Hq, P+T, D]
        v_rep = v_all.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k_rep.transpose(2, 3)) * self.scale + bias
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v_rep).transpose(1, 2).reshape(bt, t, self.num_heads * self.head_dim)
        return self.o_proj(out), k_all, v_all


class HeadLayer(nn.Module):
    """One pre-norm Llama decoder layer over the HF layer's weights."""

    def __init__(self, hf_layer: Any, cfg) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.input_layernorm = hf_layer.input_layernorm
        self.post_attention_layernorm = hf_layer.post_attention_layernorm
        self.mlp = hf_layer.mlp
        self.attn = HeadAttention(hf_layer.self_attn, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        a, k_all, v_all = self.attn(self.input_layernorm(x), cos, sin, bias, past_k, past_v)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_all, v_all


class EdgeHead(nn.Module):
    """Embedding + layers [0, k) of an HF ``LlamaForCausalLM``.

    Inputs:
        input_ids: int64 [Bt, T]
        position_ids: int64 [Bt, T], absolute positions (past length + i for row-local tokens)
        attention_mask: int64 [Bt, P+T], 1 where a key slot holds a real token
        past_key_i / past_value_i: float32 [Bt, Hkv, P, D] for i in [0, k)
    Outputs:
        hidden: float32 [Bt, T, H], the residual stream entering layer k (HF ``hidden_states[k]``)
        present_key_i / present_value_i: float32 [Bt, Hkv, P+T, D], post-RoPE

    A query at new-token index i may attend key slot j iff ``attention_mask[j] == 1`` and
    ``j <= P + i`` (causal over the slot order). Padding rows produce garbage outputs that
    callers discard.
    """

    def __init__(self, hf_model: Any, k: int) -> None:
        super().__init__()
        cfg = hf_model.config
        if not 1 <= k <= cfg.num_hidden_layers:
            raise ValueError(f"split layer k={k} outside [1, {cfg.num_hidden_layers}]")
        self.k = k
        self.embed_tokens = hf_model.model.embed_tokens
        self.rotary_emb = hf_model.model.rotary_emb
        self.layers = nn.ModuleList(HeadLayer(hf_model.model.layers[i], cfg) for i in range(k))

    def forward(self, input_ids, position_ids, attention_mask, *past: torch.Tensor):
        if len(past) != 2 * self.k:
            raise ValueError(f"expected {2 * self.k} past tensors, got {len(past)}")
        x = self.embed_tokens(input_ids)  # [Bt, T, H]
        cos, sin = self.rotary_emb(x, position_ids)
        t = input_ids.shape[1]
        total = attention_mask.shape[1]
        p = total - t
        q_slot = torch.arange(t, device=x.device).unsqueeze(1) + p  # [T, 1]
        k_slot = torch.arange(total, device=x.device).unsqueeze(0)  # [1, P+T]
        allowed = (k_slot <= q_slot).unsqueeze(0) & (attention_mask.unsqueeze(1) > 0)  # [Bt, T, P+T]
        neg = torch.finfo(x.dtype).min
        bias = torch.where(allowed, torch.zeros((), dtype=x.dtype), torch.full((), neg, dtype=x.dtype))
        bias = bias.unsqueeze(1)  # [Bt, 1, T, P+T]
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, k_all, v_all = layer(x, cos, sin, bias, past[2 * i], past[2 * i + 1])
            presents += [k_all, v_all]
        return (x, *presents)


class EdgeFull(nn.Module):
    """The whole model for edge-only inference: ``EdgeHead`` over all ``L`` layers, final
    norm and lm_head on each row's last position.

    Inputs as ``EdgeHead`` (``k = L``); outputs ``logits`` float32 ``[Bt, V]`` of the last
    new token of each row (rows must not be right-padded), then ``present_*`` as ``EdgeHead``.
    """

    def __init__(self, hf_model: Any) -> None:
        super().__init__()
        self.head = EdgeHead(hf_model, hf_model.config.num_hidden_layers)
        self.norm = hf_model.model.norm
        self.lm_head = hf_model.lm_head

    def forward(self, input_ids, position_ids, attention_mask, *past: torch.Tensor):
        hidden, *presents = self.head(input_ids, position_ids, attention_mask, *past)
        logits = self.lm_head(self.norm(hidden[:, -1]))
        return (logits, *presents)
