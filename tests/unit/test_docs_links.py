"""The docs a newcomer reads: the README stays short with the GPU commands near the top, and
every link of README, CONTRIBUTING and docs/ points at a file of this repository (none leaves
it: a link outside, such as ../shared, is broken for every reader but one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_is_short_and_shows_the_8_gpu_command_early():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    lines = readme.splitlines()
    first = next(i for i, line in enumerate(lines) if "launch/torchrun.sh --config" in line)
    assert first < 150 and "gsm8k_8gpu.yaml" in lines[first]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_points_inside_the_repository(doc: Path):
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{doc.name}: {target}"


def test_the_index_lists_every_document():
    index = (REPO / "docs" / "index.md").read_text()
    for doc in (REPO / "docs").glob("*.md"):
        if doc.name != "index.md":
            assert f"]({doc.name})" in index, doc.name
