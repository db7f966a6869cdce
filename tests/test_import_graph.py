"""Layering of core, read from the source with ``ast`` (every import statement, at module level, inside
functions or under ``TYPE_CHECKING``): no import cycles between kvbridge modules, no plugin package
imported by core (by name or built from a name), and the demo independent of the conformance kit."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvbridge

ROOT = Path(kvbridge.__file__).resolve().parent
_IMPORTERS = {"import_module", "__import__", "find_spec"}


def _module_name(path: Path) -> str:
    parts = ("kvbridge", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imported(module: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in ``module``; ``from a import b`` names ``a.b`` when that
    is a module."""
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in MODULES else base), node.lineno


def graph() -> dict[str, set[str]]:
    """Edges between kvbridge modules (a package's ``__init__`` counts only where it is named)."""
    return {m: {t for t, _ in imported(m) if t in MODULES and t != m} for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(_cycle_in(set(component), edges))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges[node] & component):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _plugin_imports(module: str) -> Iterator[str]:
    for name, line in imported(module):
        if name.split(".")[0].startswith("kvbridge_"):
            yield f"{module}:{line} imports {name}"
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in _IMPORTERS and node.args:
                arg = node.args[0]
                text = ast.unparse(arg)
                if isinstance(arg, ast.JoinedStr) or "kvbridge_" in text:
                    yield f"{module}:{node.lineno} imports a name built at run time: {called}({text})"


def test_no_import_cycles_between_core_modules() -> None:
    found = cycles(graph())
    assert not found, "import cycles in core:\n" + "\n".join(" -> ".join(c) for c in found)


def test_core_imports_no_plugin_package() -> None:
    found = [hit for m in MODULES for hit in _plugin_imports(m)]
    assert not found, "core imports plugin packages:\n" + "\n".join(found)


def test_demo_does_not_import_the_testkit() -> None:
    found = [f"{m}:{line} imports {name}" for m in MODULES if m.startswith("kvbridge.demo")
             for name, line in imported(m) if name == "kvbridge.testkit" or name.startswith("kvbridge.testkit.")]
    assert not found, "\n".join(found)


def test_the_pattern_shares_no_code_with_kvbridge() -> None:
    """The fill pattern is the independent yardstick for slicing and the planner: it imports no kvbridge."""
    assert not [name for name, _ in imported("kvbridge.pattern") if name.split(".")[0] == "kvbridge"]


def test_the_cycle_finder_reports_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]


# ------------------------------------------------------------------ the allowed-dependency matrix
# Layers (DESIGN.md §12), lowest first; a module may import its own layer and the ones below, never above.
LAYERS: dict[str, tuple[str, ...]] = {
    "model": ("kvbridge._markers", "kvbridge.errors", "kvbridge.sealing", "kvbridge.geometry", "kvbridge.pages",
              "kvbridge.logs", "kvbridge.tracing", "kvbridge.findings", "kvbridge.shmnames", "kvbridge.addresses",
              "kvbridge.pattern", "kvbridge.specs"),
    "plan": ("kvbridge.slicing", "kvbridge.planner", "kvbridge.staging", "kvbridge.spans", "kvbridge.digests",
             "kvbridge.device_digests", "kvbridge.handshake", "kvbridge.repaging", "kvbridge.state"),
    # the wire (control messages, the buffer records they carry), the state machines, and the two contracts a
    # backend meets: its methods (backends.base, whose records are the wire's) and the operation hooks
    "protocol": ("kvbridge.protocol", "kvbridge.backends.base", "kvbridge.hookspecs"),
    "runtime": ("kvbridge.agent", "kvbridge.backends", "kvbridge.links", "kvbridge.zmq_link", "kvbridge.discovery",
                "kvbridge.registry", "kvbridge.hostpool", "kvbridge.metrics", "kvbridge.settings",
                "kvbridge.local_secret", "kvbridge.clockskew"),
    "apps": ("kvbridge.cli", "kvbridge.doctor", "kvbridge.demo", "kvbridge.sim", "kvbridge.testkit", "kvbridge.plugin",
             "kvbridge"),
}
# Known upward imports, each with why it is still there; a new one fails the test (move the code down).
DEBTS = {
    ("kvbridge.specs", "kvbridge.demo"): "the demo's model presets are listed with the plugin specs",
}


def layer_of(module: str) -> int:
    """The layer of a module: the longest prefix listed (``kvbridge.backends.base`` before ``kvbridge.backends``)."""
    best, found = -1, -1
    for index, prefixes in enumerate(LAYERS.values()):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    return found


def test_every_core_module_has_a_layer() -> None:
    assert [m for m in MODULES if layer_of(m) < 0] == []


def test_no_benchmark_lives_in_core() -> None:
    """The benchmarks are the kvbridge-bench distribution (tools/bench); ``kvbridge bench`` reaches them through
    an entry point."""
    assert [m for m in MODULES if m.split(".")[1:2] and m.split(".")[1].startswith("bench")] == []


def test_imports_point_only_downward() -> None:
    names = list(LAYERS)
    upward, owed = [], set()
    for module, targets in graph().items():
        for target in targets:
            if layer_of(target) <= layer_of(module):
                continue
            debt = next(((a, b) for a, b in DEBTS if module.startswith(a) and target.startswith(b)), None)
            if debt is None:
                upward.append(f"{module} ({names[layer_of(module)]}) imports {target} ({names[layer_of(target)]})")
            else:
                owed.add(debt)
    assert upward == [], "\n".join(upward)
    assert owed == set(DEBTS), f"paid debts still listed: {set(DEBTS) - owed}"
