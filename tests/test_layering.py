"""The plugins' sources import kvbridge only through the author surface: ``kvbridge.plugin``, and the
conformance kit's package root ``kvbridge.testkit`` for their testing/bench helpers (read with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvbridge.plugin
import kvbridge.testkit

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
ALLOWED = {"kvbridge.plugin", "kvbridge.testkit"}


def _kvbridge_imports(path: Path) -> list[str]:
    """``file:line import`` for every import of a kvbridge module other than the allowed ones."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
            if node.module == "kvbridge":   # ``from kvbridge import plugin`` names the module itself
                names = [f"kvbridge.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{path.relative_to(PLUGINS.parent)}:{node.lineno} imports {name}" for name in names
                  if (name == "kvbridge" or name.startswith("kvbridge.")) and name not in ALLOWED]
    return found


def test_plugin_sources_import_only_the_author_surface() -> None:
    sources = sorted(PLUGINS.glob("*/src/**/*.py"))
    assert sources, f"no plugin sources under {PLUGINS}"
    bad = [line for path in sources for line in _kvbridge_imports(path)]
    assert not bad, "plugins must import kvbridge only via kvbridge.plugin (or kvbridge.testkit):\n" + "\n".join(bad)


def test_the_surfaces_export_what_they_list() -> None:
    for module in (kvbridge.plugin, kvbridge.testkit):
        assert sorted(module.__all__) == sorted(set(module.__all__)), f"{module.__name__}: duplicate names"
    missing = [name for name in kvbridge.plugin.__all__ if not hasattr(kvbridge.plugin, name)]
    assert not missing, f"kvbridge.plugin lists names it does not have: {missing}"
