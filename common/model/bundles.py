"""Model bundles: what one host of each role needs of a prepared model directory, with the
directory's layout, hard links to its files (copies across file systems) and a ``bundle.json``
(``common.protocol.manifest.BundleManifest``: every file with size and BLAKE3, the compatibility keys).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rich.console import Console

from tandem.common.protocol.manifest import (
    FULL_CHECK_NAME,
    FULL_DECODER,
    FULL_ONNX,
    MANIFEST_NAME,
    BundleFile,
    BundleManifest,
    ExportCheck,
    SplitManifest,
    blake3_file,
)

BUNDLES_DIR = "bundles"
DIRECT_DIR = "direct"  # the manifest of a checkpoint prepared for direct mode only (``--direct-only``)
console = Console(stderr=True)


def _tree(root: Path, rel: Path) -> list[tuple[Path, Path]]:
    """(source, path in the bundle) of every file under ``root`` (a file or a directory), placed at ``rel``."""
    if root.is_file():
        return [(root, rel)]
    return [(f, rel / f.relative_to(root)) for f in sorted(root.rglob("*")) if f.is_file()]


def _inside(split: Path, rel: str) -> Path:
    """``split / rel`` normalised, relative to the model directory.

    Raises:
        ValueError: it points out of the model directory.
    """
    path = Path(os.path.normpath(split / rel))
    if path.is_absolute() or path.parts[0] == "..":
        raise ValueError(f"{split}/{MANIFEST_NAME} names {rel!r}, outside the model directory")
    return path


def _place(src: Path, dst: Path) -> None:
    """Hard-link ``src`` at ``dst``, or copy it where a link cannot be made (another file system)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _bundle_current(bundle: Path, plan: list[tuple[Path, Path]]) -> bool:
    """Whether ``bundle`` already holds exactly ``plan``'s files as links to the same sources (a bundle
    of copies, made where links cannot be, is written anew each time)."""
    try:
        m = BundleManifest.load(bundle)
    except (FileNotFoundError, ValueError):
        return False
    if {f.path for f in m.files} != {rel.as_posix() for _, rel in plan}:
        return False
    return all((bundle / rel).is_file() and os.path.samefile(src, bundle / rel) for src, rel in plan)


def _write_bundle(bundle: Path, role: str, plan: list[tuple[Path, Path]], manifests: list[SplitManifest]) -> Path:
    if _bundle_current(bundle, plan):
        console.print(f"[bold]model[/] {role} bundle up to date ({bundle})")
        return bundle
    tmp = bundle.with_name(bundle.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    files = []
    for src, rel in plan:
        _place(src, tmp / rel)
        files.append(BundleFile(path=rel.as_posix(), size=src.stat().st_size, blake3=blake3_file(tmp / rel)))
    BundleManifest(
        role=role,
        model_id=manifests[0].model_id,
        compatibility_keys={m.split_layer: m.compatibility_key() for m in manifests},
        files=tuple(files),
    ).save(tmp)
    shutil.rmtree(bundle, ignore_errors=True)
    tmp.rename(bundle)
    total = sum(f.size for f in files)
    console.print(f"[bold]model[/] {role} bundle: {len(files)} files, {total / 1e6:.0f} MB in {bundle}")
    return bundle


def _builder_head(out: Path, split: Path, m: SplitManifest) -> list[tuple[Path, Path]]:
    """The files of the split's builder head (``m.builder_head``), placed as in the model directory.

    Raises:
        ValueError: it is missing or did not pass its check (``builder_head.head_problem``).
    """
    from tandem.common.model.builder_head import head_problem

    rel = _inside(split, m.builder_head)
    problem = head_problem(out / rel, m.split_layer)
    if problem:
        raise ValueError(problem)
    return _tree(out / rel, rel)


def write_bundles(out: Path) -> dict[str, Path]:
    """Write ``out/bundles/edge`` and ``out/bundles/cloud`` from the prepared model directory ``out``
    (idempotent). Each has the model directory's layout, holds only its role's files and a
    ``bundle.json`` (see ``BundleManifest``); the split manifests are the same files in both.

    edge: ``split-k{k}/head.onnx``, ``head-builder/`` (where the manifest names it) and
    ``manifest.json`` per split, ``tokenizer/``, ``edge-full.onnx`` (edge-only generation) and its
    check if prepared and checked, ``edge-decoder/`` if built and checked. cloud: ``hf/`` (decode
    engine), ``split-k{k}/tail/`` and ``manifest.json`` per split.

    Raises:
        FileNotFoundError: ``out`` has no prepared split.
        ValueError: a split manifest predates the tokenizer directory or records no passing check of
            its head, or ``edge-full.onnx``, ``edge-decoder/`` or a builder head failed its check (run
            ``tandem-model`` again).
    """
    found = sorted(out.glob(f"split-k*/{MANIFEST_NAME}")) + sorted(out.glob(f"{DIRECT_DIR}/{MANIFEST_NAME}"))
    if not found:
        raise FileNotFoundError(f"no prepared split under {out}: run tandem-model first")
    dirs = sorted(((SplitManifest.load(p.parent), Path(p.parent.name)) for p in found), key=lambda x: x[0].split_layer)
    manifests = [m for m, _ in dirs]
    edge: list[tuple[Path, Path]] = []
    cloud: list[tuple[Path, Path]] = []
    for m, split in dirs:
        if not m.tokenizer:
            raise ValueError(f"{out / split / MANIFEST_NAME} names no tokenizer directory: run tandem-model again")
        if m.split_layer and not m.passed_check:
            raise ValueError(
                f"{out / split / MANIFEST_NAME} records no passing check of its head: run tandem-model again"
            )
        manifest = (out / split / MANIFEST_NAME, split / MANIFEST_NAME)
        edge.append(manifest)
        cloud.append(manifest)
        if m.split_layer:  # a direct manifest (k = 0) has no head and no tail
            edge += _tree(out / _inside(split, m.head_onnx), _inside(split, m.head_onnx))
            if m.builder_head:
                edge += _builder_head(out, split, m)
            cloud += _tree(out / _inside(split, m.tail_checkpoint), _inside(split, m.tail_checkpoint))
        for rel, plan in ((_inside(split, m.tokenizer), edge), (_inside(split, m.full_checkpoint), cloud)):
            if not any(dst == rel or rel in dst.parents for _, dst in plan):
                plan += _tree(out / rel, rel)
    if (out / FULL_ONNX).is_file() and (out / FULL_CHECK_NAME).is_file():
        if not ExportCheck.load(out / FULL_CHECK_NAME).passed:
            raise ValueError(f"{out / FULL_ONNX} failed its check against HF: run tandem-model again")
        edge += [(out / FULL_ONNX, Path(FULL_ONNX)), (out / FULL_CHECK_NAME, Path(FULL_CHECK_NAME))]
    if (out / FULL_DECODER).is_dir():
        from tandem.common.model.builder_export import decoder_problem

        problem = decoder_problem(out / FULL_DECODER)
        if problem:
            raise ValueError(problem)
        edge += _tree(out / FULL_DECODER, Path(FULL_DECODER))
    root = out / BUNDLES_DIR
    return {
        "edge": _write_bundle(root / "edge", "edge", edge, manifests),
        "cloud": _write_bundle(root / "cloud", "cloud", cloud, manifests),
    }
