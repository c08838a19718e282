"""The split manifest: what the edge head and the cloud tail were cut from.

Written by model preparation next to the parts, read by both daemons, and
compared at connect time (``Negotiate``): an edge whose head was cut from other
weights, or at another split layer, must not feed a cloud tail.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

MANIFEST_NAME = "manifest.json"


class ModelShape(BaseModel):
    """Shapes of the decoder that matter on the wire."""

    model_config = ConfigDict(frozen=True)

    num_layers: int  # L of the full model
    hidden_size: int  # H
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    vocab_size: int
    max_position_embeddings: int


class SplitManifest(BaseModel):
    """One split of one checkpoint at layer ``split_layer``.

    Paths are relative to the manifest's directory. ``*_blake3`` are hex BLAKE3
    digests of the files' bytes (``checkpoint_blake3`` of the full model's weights).
    """

    model_config = ConfigDict(frozen=True)

    model_id: str
    split_layer: int  # k: the edge runs layers [0, k), the cloud [k, L)
    dtype: str  # "float32"
    shape: ModelShape
    full_checkpoint: str  # HF directory of the unsplit model (decode engine, references)
    checkpoint_blake3: str
    head_onnx: str
    head_blake3: str
    tail_checkpoint: str
    tail_blake3: str
    onnx_opset: int

    @property
    def head_kv_bytes_per_token(self) -> int:
        """Bytes of head KV (layers [0, k), K and V) per token in fp32."""
        s = self.shape
        return self.split_layer * 2 * s.num_kv_heads * s.head_dim * 4

    def compatibility_key(self) -> str:
        """What edge and cloud must agree on: model, weights, split layer and head."""
        return f"{self.model_id}|{self.checkpoint_blake3}|k={self.split_layer}|{self.head_blake3}"

    def save(self, directory: Path) -> Path:
        path = directory / MANIFEST_NAME
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, directory: Path) -> SplitManifest:
        """Read ``directory/manifest.json``.

        Raises:
            FileNotFoundError: no manifest there (run ``make model``).
            pydantic.ValidationError: the file is not a manifest.
        """
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no split manifest at {path}; run `make model` first")
        return cls.model_validate(json.loads(path.read_text()))

    def resolve(self, directory: Path, rel: str) -> Path:
        return (Path(directory) / rel).resolve()
