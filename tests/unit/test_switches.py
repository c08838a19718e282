"""The behaviour switches table (``common.model.switches.plan``) on transformers configs (no weights): what
is refused with one line, which side of a LongRoPE threshold a deployment's graphs are exported at,
the vLLM overrides that make its sliding windows HF's, the range of ``max_model_len`` a plan holds
for and the length of the check row past the switches; the tail config keeps each layer's attention."""

from __future__ import annotations

import pytest

from tandem.common.model import switches
from tandem.common.model.head_model import FAMILIES, UnsupportedArchitecture
from tandem.common.protocol.manifest import EngineAgreement
from tests.families import FAMILY_NAMES, ORIGINAL_POSITIONS, WINDOW_TOKENS, family_config

ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def config(name: str, **changes):
    """``tests.families``' config of ``name`` (a family or a switch checkpoint), its architecture
    named, with ``changes`` set on it."""
    cfg = family_config(name)
    cfg.architectures = [ARCH[name.split("-")[0]]]
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_every_family_has_a_vllm_window_rule():
    assert set(switches.VLLM_WINDOWS) == set(FAMILIES)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_family_checkpoints_need_no_override(name):
    a = switches.plan(config(name), 512)
    assert (a.hf_overrides, a.export_overrides) == ({}, {})
    assert (a.max_model_len_min_tokens, a.max_model_len_max_tokens) == (2, 512)
    windowed = name in ("mistral", "gemma2", "gemma3")
    assert a.check_tokens == (WINDOW_TOKENS + switches.CHECK_PAST_SWITCH_TOKENS if windowed else 0)


def test_longrope_is_exported_with_the_factors_vllm_uses_for_the_deployment():
    cfg = config("phi3-longrope")
    rope = cfg.rope_parameters
    long = switches.plan(cfg, 512)  # vLLM: the long factors at every position
    assert long.export_overrides == {"rope_parameters": {**rope, "short_factor": rope["long_factor"]}}
    assert (long.max_model_len_min_tokens, long.max_model_len_max_tokens) == (ORIGINAL_POSITIONS + 1, 512)
    assert long.check_tokens == ORIGINAL_POSITIONS + switches.CHECK_PAST_SWITCH_TOKENS  # past the threshold
    assert "long factors" in long.notes[0]
    short = switches.plan(cfg, ORIGINAL_POSITIONS)  # vLLM: the short factors, the threshold never reached
    assert short.export_overrides == {} and short.check_tokens == 0
    assert (short.max_model_len_min_tokens, short.max_model_len_max_tokens) == (2, ORIGINAL_POSITIONS)
    # a cloud on the other side of the threshold is refused, by the range and why
    assert "longrope" in long.refusal(ORIGINAL_POSITIONS) and long.refusal(ORIGINAL_POSITIONS + 1) == ""
    assert "--max-model-len-tokens 65" in short.refusal(ORIGINAL_POSITIONS + 1) and short.refusal(2) == ""
    assert long.key() and not short.key()  # heads of the two choices do not pair


def test_a_longrope_attention_factor_vllm_computes_otherwise_is_refused():
    cfg = config("phi3-longrope")
    cfg.rope_parameters = {**cfg.rope_parameters, "attention_factor": 1.5}
    with pytest.raises(switches.Unservable, match=r"attention factor is 1\.5 in HF") as e:
        switches.plan(cfg, 512)
    one_line(e)


@pytest.mark.parametrize(
    ("rope", "words"),
    [
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "rescales a dynamic rope"),
        ({"rope_type": "mrope", "rope_theta": 10000.0}, "has not checked"),
    ],
)
def test_a_rope_whose_length_switch_cannot_be_exported_is_refused(rope, words):
    with pytest.raises(switches.Unservable, match=words) as e:
        switches.plan(config("llama", rope_parameters=rope), 512)
    one_line(e)


def test_a_window_hf_ignores_is_dropped_from_vllm():
    """HF's Llama ignores ``sliding_window``; vLLM's would apply it to every layer."""
    cfg = config("llama-window")
    assert switches.hf_windows(FAMILIES["LlamaForCausalLM"], cfg) == [None] * 4
    assert switches.vllm_windows("LlamaForCausalLM", cfg) == [WINDOW_TOKENS] * 4
    a = switches.plan(cfg, 512)
    assert a.hf_overrides == {"sliding_window": None} and a.export_overrides == {}
    assert a.check_tokens == 0 and a.max_model_len_max_tokens == 512  # no window left on either side
    # Llama layer_types naming sliding layers: vLLM honours them, HF does not
    typed = config("llama-window", layer_types=["sliding_attention", "full_attention"] * 2)
    assert switches.vllm_windows("LlamaForCausalLM", typed) == [WINDOW_TOKENS, None] * 2
    assert switches.plan(typed, 512).hf_overrides == {"sliding_window": None}


def test_qwen2_sliding_on_some_layers_only_is_refused_by_name():
    with pytest.raises(switches.Unservable, match=r"Qwen2ForCausalLM slides .* on 2 of its 4 layers") as e:
        switches.plan(config("qwen2-partial-window"), 512)
    assert "max_window_layers 2" in one_line(e)
    with pytest.raises(switches.Unservable, match="Qwen3ForCausalLM"):  # Qwen3 runs on vLLM's Qwen2 model
        switches.plan(
            config(
                "qwen3",
                use_sliding_window=True,
                sliding_window=8,
                layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
            ),
            512,
        )


def test_qwen2_sliding_on_every_layer_or_none_is_served():
    every = family_config("qwen2")
    every.architectures = [ARCH["qwen2"]]
    every.sliding_window, every.layer_types = WINDOW_TOKENS, ["sliding_attention"] * 4
    a = switches.plan(every, 512)
    assert a.hf_overrides == {} and "every layer in HF and vLLM" in a.notes[0]
    # max_window_layers at the layer count: no layer slides in HF, and none in vLLM
    none = family_config("qwen2")
    none.architectures = [ARCH["qwen2"]]
    none.sliding_window, none.layer_types = WINDOW_TOKENS, ["full_attention"] * 4
    assert switches.vllm_windows("Qwen2ForCausalLM", none) == [None] * 4
    assert switches.plan(none, 512).notes == ()


def test_a_head_dim_qwen2_in_vllm_ignores_is_refused():
    with pytest.raises(
        switches.Unservable, match="sets head_dim 64, but vLLM 0.32's model of it ignores head_dim"
    ) as e:
        switches.plan(config("qwen2-head-dim"), 512)
    one_line(e)
    assert switches.plan(config("qwen3", head_dim=64), 512).notes == ()  # Qwen3 reads it


def test_a_window_past_the_deployment_bounds_its_max_model_len():
    """A window the check does not pass (the deployment cannot reach it) bounds the clouds it pairs with."""
    cfg = config("mistral", sliding_window=256)
    short = switches.plan(cfg, 128)
    assert short.check_tokens == 0 and short.max_model_len_max_tokens == 256
    assert "256" in short.refusal(512) and short.refusal(256) == ""
    reached = switches.plan(cfg, 512)
    assert reached.check_tokens == 256 + switches.CHECK_PAST_SWITCH_TOKENS and reached.max_model_len_max_tokens == 512


def test_a_max_model_len_beyond_the_positions_and_another_architecture_are_refused():
    with pytest.raises(switches.Unservable, match="outside"):
        switches.plan(config("llama"), 513)
    cfg = config("llama")
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedArchitecture):
        switches.plan(cfg, 512)


def test_the_tail_config_keeps_each_layers_attention():
    cfg = {
        "num_hidden_layers": 4,
        "max_window_layers": 2,
        "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2,
    }
    tail = switches.tail_config(cfg, 1)
    assert tail == {
        "num_hidden_layers": 3,
        "max_window_layers": 1,
        "layer_types": ["full_attention"] + ["sliding_attention"] * 2,
    }
    assert switches.tail_config(cfg, 3)["max_window_layers"] == 0
    assert cfg["num_hidden_layers"] == 4  # not changed in place


def test_a_manifest_without_an_agreement_holds_for_every_length_up_to_its_positions():
    from tests.doubles import toy_manifest

    m = toy_manifest().model_copy(update={"weights_blake3": "w"})
    assert m.engine_agreement is None and m.agreement == EngineAgreement(
        max_model_len_max_tokens=m.shape.max_position_embeddings
    )
    assert m.agreement.refusal(m.shape.max_position_embeddings) == ""
    assert "|export=" not in m.compatibility_key()
    longrope = m.model_copy(
        update={"engine_agreement": EngineAgreement(max_model_len_max_tokens=8, export_overrides={"x": 1})}
    )
    assert longrope.compatibility_key().startswith(m.compatibility_key() + "|export=")


STATIC_ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 1e6},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.3,
        "rope_theta": 1e6,
    },
]


def _vllm_cos_sin(cfg, max_model_len: int, monkeypatch):
    """vLLM's cos and sin ``[max_model_len, D/2]`` (mscale applied) for positions ``0 ..
    max_model_len - 1`` of ``cfg``'s rope, built as its engines build it."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import get_rope, phi3_long_rope_scaled_rope

    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len))
    monkeypatch.setattr(phi3_long_rope_scaled_rope, "get_current_vllm_config", lambda: engine)
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})  # get_rope's cache is keyed without max_model_len
    d = cfg.hidden_size // cfg.num_attention_heads
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(d, max_position=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope_parameters))
    if hasattr(rope, "long_short_cos_sin_cache"):  # LongRoPE: the short rows, then the long ones
        offset = rope.original_max_position_embeddings if rope.use_long_rope else 0
        cache = rope.long_short_cos_sin_cache[offset : offset + max_model_len]
    else:
        cache = rope.cos_sin_cache[:max_model_len]
    return cache[:, : d // 2], cache[:, d // 2 :]


def _hf_cos_sin(cfg, positions: int, overrides: dict):
    """HF's cos and sin ``[positions, D/2]`` (attention factor applied) for one call over positions
    ``0 .. positions - 1``, the config's values replaced by ``overrides``."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_cfg = switches._with(cfg, overrides)
    rotary = (Phi3RotaryEmbedding if hf_cfg.architectures[0] == "Phi3ForCausalLM" else LlamaRotaryEmbedding)(hf_cfg)
    d = cfg.hidden_size // cfg.num_attention_heads
    cos, sin = rotary(torch.zeros(1, 1, d), torch.arange(positions)[None])
    return cos[0, :, : d // 2], sin[0, :, : d // 2]


@pytest.mark.parametrize("rope", STATIC_ROPES, ids=[f"{r['rope_type']}-{i}" for i, r in enumerate(STATIC_ROPES)])
def test_a_static_rope_is_one_function_in_hf_and_vllm(rope, monkeypatch):
    pytest.importorskip("vllm")
    cfg = config("llama", rope_parameters=rope)
    assert switches.plan(cfg, 512).export_overrides == {}
    want = _vllm_cos_sin(cfg, 512, monkeypatch)
    for got, w in zip(_hf_cos_sin(cfg, 512, {}), want, strict=True):
        assert float((got - w).abs().max()) < 1e-6


@pytest.mark.parametrize("max_model_len", [ORIGINAL_POSITIONS, 512])
def test_longrope_exported_as_planned_is_vllms_rope_at_every_position(max_model_len, monkeypatch):
    """On either side of the threshold, HF loaded with the plan's export overrides computes vLLM's
    rope at every position the deployment reaches, in a call of any length (HF alone switches by the
    call's length: a short call would take the short factors)."""
    pytest.importorskip("vllm")
    cfg = config("phi3-longrope")
    overrides = switches.plan(cfg, max_model_len).export_overrides
    want = _vllm_cos_sin(cfg, max_model_len, monkeypatch)
    for positions in (16, max_model_len):  # a short call and one over every position
        for got, w in zip(_hf_cos_sin(cfg, positions, overrides), want, strict=True):
            assert float((got - w[:positions]).abs().max()) < 1e-6, (max_model_len, positions)
    if max_model_len > ORIGINAL_POSITIONS:  # the checkpoint's own config differs from vLLM for a short call
        got, _ = _hf_cos_sin(cfg, 16, {})
        assert float((got - want[0][:16]).abs().max()) > 1e-2


def test_a_yarn_rope_bounds_max_model_len_at_vllms_table():
    """vLLM's YaRN table holds ``original_max_position_embeddings * factor`` rows."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
    cfg = config("llama", rope_parameters=rope)
    assert switches.plan(cfg, 256).max_model_len_max_tokens == 256
    with pytest.raises(switches.Unservable, match="vLLM computes it for 256 positions") as e:
        switches.plan(cfg, 512)
    one_line(e)


def test_a_tail_whose_windows_differ_from_its_layers_is_refused():
    """A tail config that kept ``max_window_layers`` while its layers moved down would slide on
    other layers than the full model's (Qwen2 derives ``layer_types`` from it)."""
    import transformers as tf

    full = config("qwen2", use_sliding_window=True, sliding_window=WINDOW_TOKENS, max_window_layers=0)
    full.layer_types = ["sliding_attention"] * 4
    good = tf.Qwen2Config(**switches.tail_config(full.to_dict(), 1))
    switches.check_tail(full, good, 1, {})
    stale = tf.Qwen2Config(**{**switches.tail_config(full.to_dict(), 1), "layer_types": ["full_attention"] * 3})
    with pytest.raises(switches.Unservable, match="the tail at k=1"):
        switches.check_tail(full, stale, 1, {})
