"""tools/typecheck.py, the type check of ``make check``: it gives mypy every installed module of the
package under its installed name and the real file, so mypy resolves ``tandem.common...`` imports
between the repository's folders and names the real files in its errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.layers import tandem_modules

ROOT = Path(__file__).resolve().parents[2]


def _typecheck():
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / "tools" / "typecheck.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_module_of_the_tree_is_installed_and_checked():
    """The check's sources are the modules the layering test reads from the folders: a folder of
    code missing from pyproject's package list would be neither installed nor checked."""
    tc = _typecheck()
    checked = {s.module: s.path for s in tc.sources(ROOT, [r"^tandem/v1/"])}
    assert checked == {m: str(p.relative_to(ROOT)) for m, p in tandem_modules().items()}
    assert checked["tandem.edge.node"] == "edge/node.py" and "tandem.v1.tandem_pb2" not in checked


def test_installed_path_reads_as_in_site_packages():
    tc = _typecheck()
    assert tc.installed_path("tandem.edge", Path("edge/__init__.py")) == "tandem/edge/__init__.py"
    assert tc.installed_path("tandem.edge.node", Path("edge/node.py")) == "tandem/edge/node.py"


def test_errors_across_mapped_folders_name_the_real_files(tmp_path):
    """A project laid out like this one (``pkg.sub`` kept in ``sub/``): a call into ``sub/`` by its
    installed name with a wrong argument type is an error (with missing imports ignored, an import mypy
    could not resolve would pass silently); an error in ``sub/`` names ``sub/``; an excluded module is
    not checked."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pkg", "pkg.sub", "pkg.gen"]\n'
        '[tool.setuptools.package-dir]\n"pkg" = "pkg"\n"pkg.sub" = "sub"\n'
        '[tool.mypy]\nignore_missing_imports = true\nexclude = ["^pkg/gen/"]\n'
    )
    for folder in ("pkg", "sub", "pkg/gen"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "sub" / "base.py").write_text("def double(n: int) -> int:\n    return 2 * n\n")
    (tmp_path / "sub" / "wrong.py").write_text('z: int = "z"\n')
    (tmp_path / "pkg" / "use.py").write_text('from pkg.sub.base import double\n\nx = double("2")\n')
    (tmp_path / "pkg" / "gen" / "made.py").write_text('y: int = "generated"\n')
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "typecheck.py"), "--root", str(tmp_path), "--cache-dir", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert 'pkg/use.py:3: error: Argument 1 to "double" has incompatible type "str"' in run.stdout, run.stdout
    assert "sub/wrong.py:1: error: Incompatible types in assignment" in run.stdout, run.stdout
    assert "made.py" not in run.stdout and "checked 5 source files" in run.stdout, run.stdout
