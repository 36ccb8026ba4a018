"""docs/metrics.md stays true to the source: each name it lists is still built by the code,
and each metric prefix the code builds has its section.

The source's names are its string literals and f-strings (a formatted value read as `*`);
a name the code composes (`f"rollout_corr/{k}"` over a dict of `"k3_kl"`, ...) counts when
its prefix is such an f-string and its rest a literal. Strings with a `/` that are not
metrics (paths, data sources) are listed in NOT_METRICS.
"""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatchcase
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "metrics.md"
NAME = re.compile(r"^[a-z][a-z_-]*/[\w@./*-]*$")  # a metric-like string: family/...
NOT_METRICS = {  # first path parts of strings with a `/` in rlhf/ that name no metric
    "activ",  # memory report columns
    "configs",
    "cuda",
    "hiyouga",  # data sources
    "lighteval",
    "openai",
    "logs",
    "model",
    "rlhf-distributed-optimizer",  # checkpoint format ids
    "sim",
    "stage",  # a profiled step's stage ranges in its trace (`rlhf.logging.profiler`)
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def source_strings() -> set[str]:
    """Every string literal and f-string (formatted values as `*`) of rlhf/, docstrings
    left out."""
    found = set()
    for path in (REPO / "rlhf").rglob("*.py"):
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        parts_of_fstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts_of_fstrings.update(id(v) for v in node.values)
                found.add(
                    "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
                )
        found.update(
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            if id(node) not in skip and id(node) not in parts_of_fstrings
        )
    return found


def documented() -> list[str]:
    """The names in the first column of the page's tables, placeholders (`<source>`) as
    `*`."""
    names = []
    for line in PAGE.read_text().splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names += [re.sub(r"<[^>]+>", "*", n) for n in re.findall(r"`([^`]+)`", first)]
    return names


def built_by_the_source(name: str, strings: set[str]) -> bool:
    """Whether the code builds `name`: a literal or f-string of its own; a prefix f-string
    (`timing_s/*`, the role's `*/*`) and a literal rest; or an f-string of the rest after a
    formatted prefix (`*/mean@*`) whose own f-string (`val-core/*/*`) the head matches."""
    if name in strings:
        return True
    patterns = [q for q in strings if "*" in q and re.search("[a-z]{3}", q)]
    for i in range(1, len(name)):
        head, rest = name[:i], name[i:]
        if "*" + rest in strings and any(fnmatchcase(head, q) for q in patterns):
            return True
        if rest not in strings or not re.search("[a-z]", rest):
            continue
        if head + "*" in strings:
            return True
        if head.endswith("/") and head[:-1] in strings and "*/*" in strings:  # f"{role}/{k}"
            return True
    return False


def test_every_documented_name_is_built_by_the_source():
    strings = source_strings()
    names = documented()
    assert len(names) > 80
    missing = [n for n in names if not built_by_the_source(n, strings)]
    assert missing == [], f"docs/metrics.md lists names the source no longer builds: {missing}"


def test_every_metric_prefix_of_the_source_is_documented():
    families = {s.split("/")[0] for s in source_strings() if NAME.match(s)} - NOT_METRICS
    sections = set(re.findall(r"^## (.*)$", PAGE.read_text(), flags=re.M))
    headed = {f for title in sections for f in re.findall(r"([a-z_-]+)/", title.split(":")[0])}
    assert "actor" in families and "val-core" in families and "timing_s" in families
    assert sorted(families - headed) == [], "a metric prefix without a section in docs/metrics.md"


def test_the_page_is_linked_from_the_index():
    assert "(metrics.md)" in (REPO / "docs" / "index.md").read_text()
