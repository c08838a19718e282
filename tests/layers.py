"""The layering of the package tree, written once: ``LAYERS`` orders the modules of ``tandem``
bottom first; an import must name a module of its own layer or of a layer below; the edge and the
cloud never import each other; nothing but the tests imports the benchmarks. Imports inside
functions and under ``TYPE_CHECKING`` count (they are dependencies all the same). Checked by
``tests/unit/test_layers.py``; ``tests/unit/test_typecheck.py`` checks the type check sees every
module listed here."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module belongs to the layer of the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    # the SDK and the generated protocol
    ("tandem.v1",),
    (
        "tandem.pbconv",
        "tandem.errors",
        "tandem.ranges",
        "tandem.stages",
        "tandem.security",
        "tandem.chat_request",
        "tandem.streams",
    ),
    ("tandem.connection",),
    ("tandem.edge_info", "tandem.client", "tandem.daemons", "tandem.demo", "tandem"),
    # what both daemons share
    ("tandem.common.protocol",),
    ("tandem.common.wire",),
    ("tandem.common.runtime",),
    ("tandem.common.model",),
    # the cloud
    ("tandem.cloud.turn", "tandem.cloud.splits", "tandem.cloud.metrics"),
    ("tandem.cloud.store",),
    ("tandem.cloud.config",),
    ("tandem.cloud.engines",),
    ("tandem.cloud.sessions.table", "tandem.cloud.sessions.store"),
    ("tandem.cloud.links",),
    ("tandem.cloud.sessions.sync",),
    ("tandem.cloud.uploads",),
    ("tandem.cloud.engine_calls",),
    ("tandem.cloud.remote_prefill", "tandem.cloud.gateway"),
    ("tandem.cloud.service",),
    ("tandem.cloud.server", "tandem.cloud.cli", "tandem.cloud"),
    # the edge
    ("tandem.edge.session", "tandem.edge.detok", "tandem.edge.events", "tandem.edge.validation", "tandem.edge.metrics"),
    ("tandem.edge.compute",),
    ("tandem.edge.link",),
    ("tandem.edge.routing",),
    ("tandem.edge.turn", "tandem.edge.lifetime"),
    ("tandem.edge.modes",),
    ("tandem.edge.node",),
    ("tandem.edge.api",),
    ("tandem.edge.config", "tandem.edge.server", "tandem.edge.cli", "tandem.edge"),
    # the benchmarks drive everything
    ("tandem.benchmarks",),
]
APART = [("tandem.edge", "tandem.cloud")]  # neither imports the other
SOURCES = {"tandem": ROOT / "tandem", "tandem.edge": ROOT / "edge", "tandem.cloud": ROOT / "cloud"}
SOURCES |= {"tandem.common": ROOT / "common", "tandem.benchmarks": ROOT / "benchmarks"}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``module``'s longest matching prefix.

    Raises:
        LookupError: no layer names it."""
    best = max(
        ((len(p), i) for i, group in enumerate(LAYERS) for p in group if _under(module, p)),
        default=None,
    )
    if best is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS")
    return best[1]


@functools.cache
def tandem_modules() -> dict[str, Path]:
    """Every module of the installed ``tandem`` package, by dotted name (generated code and the
    benchmarks' result scripts left out)."""
    found: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            if "results" in rel.parts or (package == "tandem" and rel.parts[0] in ("v1", "edge", "cloud", "common")):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imported(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every ``tandem`` import in ``path``; ``from P import m`` names
    ``P.m`` where that is a module, else ``P``."""
    modules = tandem_modules()
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _under(a.name, "tandem")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _under(node.module, "tandem"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if sub in modules else node.module))
    return out


def _across(module: str, target: str, a: str, b: str) -> bool:
    return (_under(module, a) and _under(target, b)) or (_under(module, b) and _under(target, a))


def violations() -> list[str]:
    found: list[str] = []
    for module, path in sorted(tandem_modules().items()):
        here = layer_of(module)
        for line, target in imported(path):
            if target.startswith("tandem.v1"):
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if any(_across(module, target, a, b) for a, b in APART):
                found.append(f"{where}: {module} imports {target} across the edge/cloud divide")
            elif layer_of(target) > here:
                found.append(f"{where}: {module} (layer {here}) imports {target} (layer {layer_of(target)}) upward")
    return found
