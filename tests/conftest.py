"""Shared fixtures. The prepared model comes from `make model` (models/smollm2-135m)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("TANDEM_MODEL_DIR", ROOT / "models" / "smollm2-135m"))
SPLIT_DIR = MODEL_DIR / "split-k4"


@pytest.fixture(scope="session")
def split_dir() -> Path:
    if not (SPLIT_DIR / "manifest.json").is_file():
        pytest.fail(f"no prepared model at {SPLIT_DIR}: run `make model` (make test does it)")
    return SPLIT_DIR


@pytest.fixture(scope="session")
def manifest(split_dir):
    from tandem.common.manifest import SplitManifest

    return SplitManifest.load(split_dir)


@pytest.fixture(scope="session")
def hf_model(manifest, split_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        manifest.resolve(split_dir, manifest.full_checkpoint), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tokenizer(manifest, split_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(manifest.tokenizer_dir(split_dir))
