"""The test tiers are the folders of ``tests/``: every collected test in a tier's folder carries that
tier's marker (so ``-m engines`` and ``-m "not engines and not install and not gpu"`` select by
folder), a test file in ``tests/`` itself carries only its own markers, and no test module imports
another test module."""

from __future__ import annotations

import ast

import pytest

from tests.helpers import ROOT, TIERS, tier_of


def test_the_tier_of_a_file_is_its_folder():
    tests = ROOT / "tests"
    assert tier_of(tests / "engines" / "test_x.py") == "engines"
    assert tier_of(tests / "unit" / "sub" / "test_x.py") == "unit"
    assert tier_of(tests / "test_x.py") is None  # the root keeps its explicit markers
    assert tier_of(tests / "data" / "test_x.py") is None  # a folder that is no tier
    assert tier_of(ROOT / "benchmarks" / "test_x.py") is None


def test_every_collected_test_carries_its_folders_marker(request):
    items = request.session.items
    assert items
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            assert item.get_closest_marker(tier) is not None, item.nodeid
            others = [t for t in TIERS if t != tier and item.get_closest_marker(t) is not None]
            assert others in ([], ["engines"], ["gpu"]), (item.nodeid, others)


def test_every_tier_is_a_registered_marker(pytestconfig):
    registered = {m.split(":")[0].strip() for m in pytestconfig.getini("markers")}
    assert set(TIERS) <= registered


@pytest.mark.parametrize("tier", TIERS)
def test_no_test_module_imports_another(tier):
    for path in sorted((ROOT / "tests" / tier).rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                last = node.module.rsplit(".", 1)[-1]
                assert not last.startswith("test_") and last != "conftest", f"{path.name} imports {node.module}"
