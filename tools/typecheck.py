"""mypy over the package ``tandem`` by its installed names, reading the sources where they are.

The repository keeps ``edge/``, ``cloud/``, ``common/`` and ``benchmarks/`` beside ``tandem/``; installed,
they are ``tandem.edge``, ``tandem.cloud``, ... (pyproject's ``[tool.setuptools] packages`` and
``package-dir``). mypy's command line names a module by the folders above its file, so this script hands
mypy each source file with its installed module name (mypy's ``BuildSource``), taken from that same
pyproject mapping: no copy, no tree of links, no install, and errors name the real files
(``edge/node.py:12: error: ...``).

Checked: every module of every listed package, less those whose installed path (``tandem/v1/x.py``)
matches a pattern of ``[tool.mypy] exclude``. Imports outside the list (``tandem.v1``'s stubs) are found
from the repository root as mypy finds any import. Options come from ``[tool.mypy]``; extra arguments
are mypy flags (``--cache-dir DIR``).

Usage: ``python tools/typecheck.py [--root DIR] [MYPY FLAGS]``; exit 0 when clean, 1 with errors, 2 when
mypy could not check (a syntax error, a bad flag).
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource
from mypy.util import count_stats, hard_exit


def installed_modules(root: Path) -> dict[str, Path]:
    """Every module that installing ``root``'s project gives, by dotted name, to its source file
    (relative to ``root``): the ``*.py`` files of each package in ``[tool.setuptools] packages``, the
    package's folder found through ``package-dir`` (its longest mapped prefix).

    Raises:
        FileNotFoundError: a listed package has no folder.
    """
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    found: dict[str, Path] = {}
    for package in setuptools["packages"]:
        folder = _folder_of(package, package_dir)
        if not (root / folder).is_dir():
            raise FileNotFoundError(f"package {package}: no folder {folder}")
        for path in sorted((root / folder).glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[module] = path.relative_to(root)
    return found


def _folder_of(package: str, package_dir: dict[str, str]) -> Path:
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return Path(package_dir[prefix], *parts[n:])
    return Path(package_dir.get("", "."), *parts)


def installed_path(module: str, source: Path) -> str:
    """The module's path inside site-packages (``tandem/edge/node.py``), as ``exclude`` patterns read it."""
    parts = module.split(".")
    if source.stem == "__init__":
        parts.append("__init__")
    return "/".join(parts) + ".py"


def sources(root: Path, exclude: list[str]) -> list[BuildSource]:
    """One ``BuildSource`` per installed module not excluded: the real file (relative to ``root``) under its
    installed name."""
    return [
        BuildSource(str(path), module, base_dir=str(root))
        for module, path in installed_modules(root).items()
        if not any(re.search(p, installed_path(module, path)) for p in exclude)
    ]


def main(argv: list[str]) -> int:
    root = Path.cwd()
    if argv[:1] == ["--root"]:
        root, argv = Path(argv[1]).resolve(), argv[2:]
    os.chdir(root)  # paths in messages and the cache relative to the project
    _, options = process_options(["--config-file", "pyproject.toml", *argv], require_targets=False)
    todo = sources(Path("."), options.exclude)
    try:
        _KEPT.append(build.build(todo, options))  # freed by the exit only: see __main__
        messages, blocked = _KEPT[-1].errors, False
    except CompileError as e:
        messages, blocked = e.messages, True
    for line in messages:
        print(line)
    n_errors, n_notes, n_files = count_stats(messages)
    if blocked:
        return 2
    if n_errors:
        print(
            f"Found {n_errors} error{'s' * (n_errors != 1)} in {n_files} file{'s' * (n_files != 1)} "
            f"(checked {len(todo)} source files)"
        )
        return 1
    print(f"Success: no issues found in {len(todo)} source files")
    return 0


_KEPT: list[build.BuildResult] = []

if __name__ == "__main__":
    # out without freeing mypy's graph one object at a time (40 s of CPU on this tree's cold run
    # against 55 s of checking), as mypy's own command leaves
    hard_exit(main(sys.argv[1:]))
