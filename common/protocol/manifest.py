"""The split manifest: what the edge head and the cloud tail were cut from.

Written by model preparation next to the parts, read by both daemons, and
compared at connect time (``Negotiate``): an edge whose head was cut from other
weights, or at another split layer, must not feed a cloud tail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_NAME = "manifest.json"
FULL_ONNX = "edge-full.onnx"  # the whole model with lm_head: local mode on the edge
BUNDLE_MANIFEST_NAME = "bundle.json"
FULL_CHECK_NAME = "edge-full.check.json"  # the check of edge-full.onnx against HF (``ExportCheck``)
DEFAULT_MAX_MODEL_LEN_TOKENS = 2048  # the engines' max_model_len unless set (the cloud's and tandem-model's)
FULL_DECODER = "edge-decoder"  # the whole model built by ONNX Runtime GenAI's model builder (local mode)


class EngineAgreement(BaseModel):
    """How a preparation makes the edge's graphs and the cloud's vLLM engines compute one function
    (``common.model.switches.plan``): the range of the engines' ``max_model_len`` it holds for, the config
    values the engines start with, the config values HF was exported and checked with, and what was
    found at each behaviour switch (rope scaling thresholds, sliding windows)."""

    model_config = ConfigDict(frozen=True)

    max_model_len_min_tokens: int = 2
    max_model_len_max_tokens: int  # beyond it a switch the check did not pass, or another rope choice
    # config values every vLLM engine of the model starts with (vLLM's ``hf_overrides``)
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    # config values the HF model was loaded with for the export and the check (e.g. longrope's factors)
    export_overrides: dict[str, Any] = Field(default_factory=dict)
    notes: tuple[str, ...] = ()  # one line per switch found and how it is met
    check_tokens: int = 0  # the longest check row: past every switch the deployment reaches (0: none needed)

    def refusal(self, max_model_len_tokens: int) -> str:
        """Why engines of ``max_model_len_tokens`` must not pair with this preparation ("" when they may)."""
        lo, hi = self.max_model_len_min_tokens, self.max_model_len_max_tokens
        if lo <= max_model_len_tokens <= hi:
            return ""
        why = "; ".join(self.notes) or "a behaviour switch the check did not pass"
        return (
            f"engine.max_model_len_tokens {max_model_len_tokens} is outside {lo}..{hi}, the range this model was "
            f"prepared and checked for ({why}): prepare it again with tandem-model --max-model-len-tokens "
            f"{max_model_len_tokens}"
        )

    def key(self) -> str:
        """What of the agreement the edge's graphs depend on, for ``SplitManifest.compatibility_key``:
        "" without export overrides (the checkpoint's own config)."""
        if not self.export_overrides:
            return ""
        import blake3

        text = json.dumps(self.export_overrides, sort_keys=True, separators=(",", ":"))
        return blake3.blake3(text.encode()).hexdigest()[:16]


class ExportCheck(BaseModel):
    """The check of an exported ONNX graph against the HF model it was exported from
    (``common.model.onnx_export.check_export``): the largest absolute difference over every output (the
    hidden state entering layer ``k`` or the logits, and every present key and value) on the check
    prompts, against ``tolerance``, in float32."""

    model_config = ConfigDict(frozen=True)

    architecture: str  # HF ``config.architectures[0]``, e.g. "Qwen3ForCausalLM"
    max_abs_error: float  # max |ONNX - HF| over all outputs and check tokens
    tolerance: float  # the bound it was checked against (``onnx_export.CHECK_RTOL * max(1, max |HF|)``)
    tokens: int  # check tokens run through the graph (two rows, two steps)
    passed: bool
    # the graph's arithmetic (``onnx_export.COMPUTE_DTYPES``); its inputs and outputs are float32 either way
    compute_dtype: str = "float32"
    # the agreement the graph was exported and checked under (None: before it was recorded)
    engine_agreement: EngineAgreement | None = None

    def save(self, path: Path) -> Path:
        return _write_atomic(Path(path), self.model_dump_json(indent=2))

    @classmethod
    def load(cls, path: Path) -> ExportCheck:
        """Raises:
        FileNotFoundError: no check at ``path``.
        pydantic.ValidationError: the file is not a check."""
        return cls.model_validate(json.loads(_read_json_file(Path(path))))


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
    # BLAKE3 over the full checkpoint's tensors (name, dtype, shape, bytes, in name order), whatever files
    # hold them; "" in manifests written before it existed. See ``compatibility_key``.
    weights_blake3: str = ""
    # directory of the tokenizer files and chat template (all the edge needs of the checkpoint);
    # "" in model directories prepared before it existed: the full checkpoint's
    tokenizer: str = ""
    # HF architecture of the checkpoint and the check of ``head_onnx`` against HF; absent in manifests
    # written before the check existed (such a head is not served: ``passed_check``)
    architecture: str = ""
    head_check: ExportCheck | None = None
    # how the head and the tail engines compute one function (``common.model.switches``); None in manifests
    # written before it was recorded: every max_model_len up to the model's positions, no overrides
    engine_agreement: EngineAgreement | None = None
    # the head built by ONNX Runtime GenAI's model builder (``common.model.builder_head``): its folder,
    # relative, checked against HF there (``tandem_build.json``); "" where none was built, and then
    # ``builder_head_note`` says why when preparation tried (the edge runs ``head_onnx``)
    builder_head: str = ""
    builder_head_note: str = ""

    @property
    def agreement(self) -> EngineAgreement:
        """``engine_agreement``, or for a manifest without one the model's whole range of positions."""
        return self.engine_agreement or EngineAgreement(max_model_len_max_tokens=self.shape.max_position_embeddings)

    @property
    def passed_check(self) -> bool:
        """Whether the head was checked against HF and matched (``head_check.passed``)."""
        return self.head_check is not None and self.head_check.passed

    @property
    def head_kv_bytes_per_token(self) -> int:
        """Bytes of head KV (layers [0, k), K and V) per token in fp32."""
        s = self.shape
        return self.split_layer * 2 * s.num_kv_heads * s.head_dim * 4

    def compatibility_key(self) -> str:
        """What edge and cloud must agree on: the weights, the split layer, the dtype and the shape.

        Content only, so the same weights cut at the same layer give the same key whatever torch,
        onnx, transformers or safetensors version prepared them: ``weights_blake3`` hashes the
        tensors, not the files (no ``transformers_version`` in a config, no file layout), and the
        ONNX head's bytes, which change with the exporter, are left out (the head is a function of
        these weights and ``k``; ``head_blake3`` still checks its file). The config values the head
        was exported with in place of the checkpoint's (``EngineAgreement.export_overrides``, e.g.
        longrope's long factors) are in the key when there are any. Not covered: other config fields
        beyond ``shape`` (RoPE, norm epsilon), the model id (a label). A manifest written before
        ``weights_blake3`` keys on its file hashes as before.
        """
        if not self.weights_blake3:
            return f"{self.model_id}|{self.checkpoint_blake3}|k={self.split_layer}|{self.head_blake3}"
        s = self.shape
        shape = (
            f"L{s.num_layers}.H{s.hidden_size}.Hq{s.num_heads}.Hkv{s.num_kv_heads}.D{s.head_dim}"
            f".V{s.vocab_size}.P{s.max_position_embeddings}"
        )
        key = f"tandem-split-v1|weights={self.weights_blake3}|k={self.split_layer}|{self.dtype}|{shape}"
        export = self.agreement.key()
        return f"{key}|export={export}" if export else key

    @property
    def tokenizer_path(self) -> str:
        """The directory the edge loads its tokenizer from, relative: ``tokenizer``, else (model
        directories prepared before it) the full checkpoint."""
        return self.tokenizer or self.full_checkpoint

    def tokenizer_dir(self, directory: Path) -> Path:
        """``tokenizer_path`` resolved against the manifest's directory."""
        return self.resolve(directory, self.tokenizer_path)

    def save(self, directory: Path) -> Path:
        """Write ``directory/manifest.json`` atomically (a new file, so a hard link to the old one
        in a bundle keeps the old bytes)."""
        return _write_atomic(Path(directory) / MANIFEST_NAME, self.model_dump_json(indent=2))

    @classmethod
    def load(cls, directory: Path) -> SplitManifest:
        """Read ``directory/manifest.json``.

        Raises:
            FileNotFoundError: no manifest there (run ``make model``).
            pydantic.ValidationError: the file is not a manifest.
            InvalidRequest: the file is not a regular file (a FIFO, a device) or is unreadable.
        """
        path = Path(directory) / MANIFEST_NAME
        if not path.exists():
            raise FileNotFoundError(f"no split manifest at {path}; run `make model` first")
        return cls.model_validate(json.loads(_read_json_file(path)))

    def resolve(self, directory: Path, rel: str) -> Path:
        return (Path(directory) / rel).resolve()


class BundleFile(BaseModel):
    """One file of a role bundle."""

    model_config = ConfigDict(frozen=True)

    path: str  # relative to the bundle's directory, "/"-separated
    size: int  # bytes
    blake3: str  # hex BLAKE3 of the file's bytes (what `b3sum` prints)


class BundleManifest(BaseModel):
    """``bundle.json`` of one role's bundle (``OUT/bundles/edge``, ``OUT/bundles/cloud``), written by
    ``tandem-model``: every file the role needs, with its size and BLAKE3, and the compatibility key
    of each split it holds (equal keys in the edge's and the cloud's bundle: they fit together).

    A bundle has the model directory's layout, so ``--split-dir BUNDLE/split-k{k}`` works as in it.
    """

    model_config = ConfigDict(frozen=True)

    format: int = 1
    role: str  # "edge" or "cloud"
    model_id: str
    compatibility_keys: dict[int, str]  # split layer k -> SplitManifest.compatibility_key()
    files: tuple[BundleFile, ...]

    def save(self, directory: Path) -> Path:
        return _write_atomic(Path(directory) / BUNDLE_MANIFEST_NAME, self.model_dump_json(indent=1))

    @classmethod
    def load(cls, directory: Path) -> BundleManifest:
        """Read ``directory/bundle.json``.

        Raises:
            FileNotFoundError: no bundle manifest there.
            pydantic.ValidationError: the file is not a bundle manifest.
        """
        return cls.model_validate(json.loads((Path(directory) / BUNDLE_MANIFEST_NAME).read_text()))

    def verify(self, directory: Path, hashes: bool = True) -> list[str]:
        """What is wrong with the bundle at ``directory``: missing files, other sizes and, with
        ``hashes``, other BLAKE3 digests (empty when it is intact)."""
        problems = []
        for f in self.files:
            path = Path(directory) / f.path
            if not path.is_file():
                problems.append(f"{f.path}: missing")
            elif path.stat().st_size != f.size:
                problems.append(f"{f.path}: {path.stat().st_size} bytes, expected {f.size}")
            elif hashes and blake3_file(path) != f.blake3:
                problems.append(f"{f.path}: BLAKE3 differs")
        return problems


def _read_json_file(path: Path) -> bytes:
    """The bytes of a small JSON file, read without blocking on a FIFO (``files.read_regular``).

    Raises:
        FileNotFoundError: no file at ``path``.
        InvalidRequest: not a regular file, or unreadable.
    """
    from tandem.common.protocol.files import read_regular

    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    return read_regular(path, path.name)


def part_blake3(path: Path) -> str:
    """Hex BLAKE3 of a split's part as the manifest records it (``head_blake3``, ``tail_blake3``,
    ``checkpoint_blake3``): of the file, or of a folder's ``*.safetensors`` and ``*.json`` files
    in name order; each file hashed as its name and then its bytes. Files are opened by
    ``files.open_regular`` (a FIFO is refused, never read).

    Raises:
        InvalidRequest: a file is not a regular file or is unreadable.
    """
    import blake3

    from tandem.common.protocol.files import open_regular

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    )
    for f in files:
        h.update(f.name.encode())
        with os.fdopen(open_regular(f, str(f)), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def blake3_file(path: Path) -> str:
    """Hex BLAKE3 of a file's bytes."""
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
