"""The documentation's relative links resolve: every link and image in README.md, CHANGELOG.md and
docs/*.md that is not a URL points to a file or folder of the repository and, with a ``#fragment``,
to a heading of the target markdown file (GitHub's anchor rule). Fenced code blocks are skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


def test_the_docs_exist():
    for path in DOCS:
        assert path.is_file(), path
    assert len(DOCS) > 3


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchor_follows_githubs_rule():
    assert anchor("Wire formats and fidelity (`tandem-bench fidelity`)") == (
        "wire-formats-and-fidelity-tandem-bench-fidelity"
    )
    assert anchor("What `make run` prints") == "what-make-run-prints"
