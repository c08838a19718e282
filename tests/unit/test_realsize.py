"""Random-weight checkpoints of real model shapes (``benchmarks.realsize``): the shapes have the
public models' parameter counts, and a written checkpoint loads with the embedded tokenizer and
chat template."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tandem.benchmarks.realsize import SHAPES, write_checkpoint
from tandem.common.protocol.chat import prompt_token_ids

# parameter counts of meta-llama/Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B (tied embeddings
# counted once), as their model cards and safetensors index files give them
PUBLIC_PARAMS = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("shape", sorted(PUBLIC_PARAMS))
def test_each_shape_has_the_public_models_parameter_count(shape):
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
    assert sum(p.numel() for p in model.parameters()) == PUBLIC_PARAMS[shape]


def test_a_written_checkpoint_loads_with_the_embedded_tokenizer(tmp_path, split_dir):
    tok_dir = split_dir.parent / "hf"
    write_checkpoint("tiny", tmp_path / "ckpt", tok_dir, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert model.config.num_hidden_layers == SHAPES["tiny"]["num_hidden_layers"]
    assert model.dtype == torch.bfloat16 and model.config.eos_token_id == tok.eos_token_id
    ids = prompt_token_ids(tok, [{"role": "user", "content": "hi"}])
    assert ids and max(ids) < model.config.vocab_size
    with pytest.raises(KeyError, match="unknown shape"):
        write_checkpoint("llama-9", tmp_path / "x", tok_dir)
