"""The package's shape, as the design asks for it: no import cycle between minimlx's modules (imports inside
functions count too), dependencies that point the way docs/architecture.md says, no function over 80 lines, and the
modules that grow fastest kept under 300 lines."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minimlx"
LONGEST_FUNCTION = 80
LONGEST_MODULE = 300
KEPT_SHORT = ["decode/engine.py", "server/app.py", "distributed/*.py"]
# docs/architecture.md: "core/ imports nothing of minimlx but itself, archs/ imports core/, io/ and archs/ never import
# each other ... decode/ takes a built model and token ids and knows nothing of files" (None: nothing outside itself)
NEVER_IMPORTS = {"core": None, "io": {"archs"}, "archs": {"io"}, "decode": {"io", "loading", "convert"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The minimlx modules that module `name` (at `path`) imports anywhere in its body: `from .x import y` counts as
    x.y where that is a module, else as x (a package's `__init__` or the module that defines y)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], set[str]]]:
    """Each strongly connected group of `graph`'s modules (those that import each other, directly or not), with
    one cycle through it: a path that comes back to its start."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [(cycle_through(graph, group), group) for group in groups]


def cycle_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest path from the group's first module back to itself, within the group (breadth first)."""
    start = min(group)
    paths = {target: [start, target] for target in sorted(graph[start]) if target in group}
    frontier = list(paths)
    while start not in paths:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target in group and target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    return paths[start]


def test_the_cycle_finder_finds_a_cycle_and_its_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [(["a", "b", "c", "a"], {"a", "b", "c"})]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_to_modules():
    assert "minimlx.anatomy.lens" in imported("minimlx.cli.lens", MODULES["minimlx.cli.lens"])
    assert "minimlx.cpu.blas" in imported("minimlx", MODULES["minimlx"])


def test_no_import_cycle():
    graph = {name: imported(name, path) for name, path in MODULES.items()}
    cycles = [f"{' -> '.join(path)} (a cycle among {', '.join(sorted(group))})" for path, group in import_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def part(module: str) -> str:
    """The top-level package or module of minimlx that `module` belongs to."""
    return module.split(".")[1] if "." in module else module


@pytest.mark.parametrize("package", sorted(NEVER_IMPORTS))
def test_dependencies_point_one_way(package):
    refused = NEVER_IMPORTS[package] or {part(name) for name in MODULES} - {package}
    found = [
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if part(name) == package
        for target in sorted(imported(name, path))
        if part(target) in refused
    ]
    assert not found, f"minimlx.{package} imports none of {', '.join(sorted(refused))}:\n" + "\n".join(found)


@pytest.mark.parametrize("package", sorted({path.relative_to(PACKAGE).parts[0] for path in MODULES.values()}))
def test_no_function_over_80_lines(package):
    long = []
    for path in sorted((PACKAGE / package).rglob("*.py")) if (PACKAGE / package).is_dir() else [PACKAGE / package]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("pattern", KEPT_SHORT)
def test_the_fastest_growing_modules_stay_at_most_300_lines(pattern):
    paths = sorted(PACKAGE.glob(pattern))
    assert paths, f"nothing matches minimlx/{pattern}"
    sizes = {path.relative_to(PACKAGE.parent): len(path.read_text().splitlines()) for path in paths}
    long = [f"{path} ({lines} lines)" for path, lines in sizes.items() if lines > LONGEST_MODULE]
    assert not long, f"modules over {LONGEST_MODULE} lines: " + ", ".join(long)
