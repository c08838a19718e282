"""Tiny random-weight checkpoints of every supported decoder family (``common.model.head_model.FAMILIES``),
built from transformers' configs (no hub), for the families' tests.

Each has 4 layers, hidden size 128, 4 query and 2 KV heads of dim 32 (the smallest head size vLLM's
CPU attention takes), the SmolLM2 tokenizer
(``models/smollm2-135m/tokenizer``) and a vocabulary sized to it. Sliding windows are 8 tokens, so
the test prompts cross them; Llama carries Llama-3 rope scaling, Gemma2/3 their soft-caps and
alternating sliding/global layers, Qwen3 and Gemma3 their q/k norms, Phi3 its fused projections.
Weights are drawn with ``initializer_range`` ``INIT_STD`` (transformers' default 0.02 makes every
next-token logit nearly equal, so greedy decoding would be decided by rounding): over 16 greedy steps
the gap between the two best logits is then 0.25 to 0.65 in the median and at least 0.015 (measured),
while fp32 implementations of one model differ by about 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m"
TOKENIZER_DIR = MODEL_DIR / "tokenizer"
VOCAB = 49152  # the SmolLM2 tokenizer's
INIT_STD = 0.2
WINDOW_TOKENS = 8
FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
ALTERNATING = ["sliding_attention", "full_attention"] * 2
FAMILY_SPLITS = (1, 3)  # the split layers the checkpoints are prepared at (of their 4 layers)
# checkpoints whose behaviour switches with the length or the layer in ways HF and vLLM treat differently
# (``common.model.switches``): a LongRoPE Phi3 (the rope of Phi-3-128k, Phi-3.5-mini, Phi-4-mini) switching at 64
# tokens, a Llama whose config sets a window HF's Llama ignores, a Qwen2 sliding on its upper two layers
# only, a Qwen2 whose head_dim is not hidden / heads
ORIGINAL_POSITIONS = 64  # the LongRoPE checkpoint's original_max_position_embeddings
SWITCH_NAMES = ("phi3-longrope", "llama-window", "qwen2-partial-window", "qwen2-head-dim")


def family_config(name: str) -> Any:
    """The transformers config of family ``name`` (one of ``FAMILY_NAMES`` or ``SWITCH_NAMES``) at
    the tiny shape."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    phi3 = {k: v for k, v in common.items() if k != "head_dim"}
    half = common["head_dim"] // 2  # one factor per rotary frequency
    longrope = {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
    }
    gemma = dict(sliding_window=WINDOW_TOKENS, query_pre_attn_scalar=32, layer_types=ALTERNATING)
    configs = {
        "llama": lambda: tf.LlamaConfig(**common, rope_parameters=llama3_rope),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=WINDOW_TOKENS),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common),
        "gemma2": lambda: tf.Gemma2Config(**common, **gemma),
        "gemma3": lambda: tf.Gemma3TextConfig(**common, **gemma),
        "phi3": lambda: tf.Phi3Config(**phi3),
        "phi3-longrope": lambda: tf.Phi3Config(
            **phi3, original_max_position_embeddings=ORIGINAL_POSITIONS, rope_scaling=longrope
        ),
        "llama-window": lambda: tf.LlamaConfig(**common, sliding_window=WINDOW_TOKENS),
        "qwen2-partial-window": lambda: tf.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=WINDOW_TOKENS, max_window_layers=2
        ),
        "qwen2-head-dim": lambda: tf.Qwen2Config(**{**common, "head_dim": 64}),
    }
    return configs[name]()


def with_tokenizer(out: Path) -> Path:
    """Copy the SmolLM2 tokenizer files (not its generation config) into checkpoint ``out``."""
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file() and f.name != "generation_config.json":
            shutil.copy(f, out / f.name)
    return out


def build_checkpoint(name: str, out: Path, seed: int = 0) -> Path:
    """Save a random-weight fp32 checkpoint of family ``name`` with the SmolLM2 tokenizer at ``out``.
    Biases (Qwen2's q/k/v) are drawn like the weights: HF initialises them to zero."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, INIT_STD)
    if name.startswith("gemma"):
        # Gemma ties its output layer to the embedding (vLLM's Gemma models require it) and scales
        # the embedding by sqrt(H): drawn at INIT_STD, the embedding dominates the residual stream and
        # every greedy step repeats the input token. A 10x smaller embedding lets the layers decide,
        # and a final norm of 10 (Gemma's RMSNorm scales by 1 + weight) keeps the logits apart.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.1)
            model.model.norm.weight.fill_(9.0)
    model.save_pretrained(out)
    return with_tokenizer(out)


def gpt2_checkpoint(out: Path) -> Path:
    """A tiny GPT-2 (an architecture tandem does not split; vLLM serves it) with the SmolLM2 tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2)
    tf.GPT2LMHeadModel(cfg).save_pretrained(out)
    return with_tokenizer(out)
