"""House rules that keep the package legible, checked on the source (docs/architecture.md).

The limits apply to the code as `ruff format` writes it: a `# fmt: skip` marker (packing
arguments to fit a limit) is itself a violation.

The layer order itself is an import-linter contract run by `make lint` (pyproject.toml).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "rlhf"
MAX_FILE_LINES = 1000  # one concept per module: a soft ceiling near 1,000 lines (house style)
MAX_FUNCTION_LINES = 80
FORMATTER_OFF = ("fmt: skip", "fmt: off")
PARALLEL_STATE = "megatron.core.parallel_state"
BOOTSTRAP = PACKAGE / "distributed" / "bootstrap.py"
# components take their config section or the resolved plan (rlhf.config.plan), not the tree
MAX_WHOLE_CONFIG = 15
# where ConfigError may be raised: the config's own rules, and the rules that need a model,
# the world, the data or a checkpoint (one preflight)
CONFIG_ERROR_HOMES = (PACKAGE / "config", PACKAGE / "trainer" / "preflight.py")


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "cpu_shims" not in p.parts)


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function or method longer than `limit` lines."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an import statement names, `from a import b` counted as `a` and `a.b`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_checks_see_what_they_look_for():
    tree = ast.parse(
        "def f():\n    from megatron.core import parallel_state\n" + "    x = 1\n" * 90
    )
    assert long_functions(tree, MAX_FUNCTION_LINES) == [("f", 1, 92)]
    assert formatter_overrides("x = 1  # fmt: skip\ny = 2\n") == [1]
    assert PARALLEL_STATE in imported_modules(tree)
    assert PARALLEL_STATE in imported_modules(ast.parse("import megatron.core.parallel_state"))


def formatter_overrides(source: str) -> list[int]:
    """Line numbers where a comment switches the formatter off."""
    return [
        i for i, line in enumerate(source.splitlines(), 1) if any(m in line for m in FORMATTER_OFF)
    ]


def test_the_formatter_writes_every_line():
    found = {
        str(p.relative_to(REPO)): lines
        for p in sources()
        if (lines := formatter_overrides(p.read_text()))
    }
    assert not found, f"remove the formatter overrides, split by meaning instead: {found}"


def test_no_file_over_the_line_limit():
    too_long = {
        str(p.relative_to(REPO)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not too_long, f"split these files (limit {MAX_FILE_LINES} lines): {too_long}"


def test_no_function_over_the_line_limit():
    too_long = {
        f"{p.relative_to(REPO)}:{line} {name}": length
        for p in sources()
        for name, line, length in long_functions(ast.parse(p.read_text()), MAX_FUNCTION_LINES)
    }
    assert not too_long, f"split these functions (limit {MAX_FUNCTION_LINES}): {too_long}"


def test_only_the_bootstrap_reads_megatron_global_parallel_state():
    readers = [
        str(p.relative_to(REPO))
        for p in sources()
        if p != BOOTSTRAP and PARALLEL_STATE in imported_modules(ast.parse(p.read_text()))
    ]
    assert not readers, f"pass a ParallelContext instead of reading {PARALLEL_STATE}: {readers}"
    assert PARALLEL_STATE in imported_modules(ast.parse(BOOTSTRAP.read_text()))


def import_cycles(graph) -> list[list[str]]:
    """The groups of modules that import each other in a circle (Tarjan's strongly
    connected components of more than one module), imports inside functions included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph("rlhf")
    assert len(graph.modules) > 100  # the whole package was read
    assert not import_cycles(graph), f"break these import cycles: {import_cycles(graph)}"


def test_the_cycle_check_finds_a_cycle():
    class Graph:
        def __init__(self, edges: dict[str, set[str]]):
            self.edges, self.modules = edges, set(edges)

        def find_modules_directly_imported_by(self, module: str) -> set[str]:
            return self.edges[module]

    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(Graph(edges)) == [["a", "b", "c"]]
    assert import_cycles(Graph({"a": {"b"}, "b": set()})) == []


def whole_config_functions(tree: ast.AST) -> list[str]:
    """Functions with a parameter annotated as the whole config tree (`RLHFConfig`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            annotations = [ast.unparse(a.annotation) for a in params if a.annotation]
            if any("RLHFConfig" in text for text in annotations):
                found.append(node.name)
    return found


def config_error_raises(tree: ast.AST) -> list[int]:
    """Lines of `raise ConfigError(...)`."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and ast.unparse(node.exc.func).split(".")[-1] == "ConfigError"
    ]


def test_few_functions_take_the_whole_config():
    taking = [
        f"{path.relative_to(REPO)}:{name}"
        for path in sources()
        for name in whole_config_functions(ast.parse(path.read_text()))
    ]
    assert len(taking) <= MAX_WHOLE_CONFIG, (
        f"{len(taking)} functions take the whole RLHFConfig (at most {MAX_WHOLE_CONFIG}): "
        f"give the new ones their section or the RunPlan: {taking}"
    )


def test_config_errors_are_raised_in_config_and_the_preflight():
    outside = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sources()
        if not any(path == home or home in path.parents for home in CONFIG_ERROR_HOMES)
        for line in config_error_raises(ast.parse(path.read_text()))
    ]
    assert not outside, f"raise the domain's own UserError, or move the rule: {outside}"


def test_the_config_checks_see_what_they_look_for():
    code = ast.parse(
        "def f(cfg: RLHFConfig, n: int): raise ConfigError('x')\n"
        "def g(data: DataConfig): raise ToolConfigError('y')\n"
    )
    assert whole_config_functions(code) == ["f"]
    assert config_error_raises(code) == [1]
