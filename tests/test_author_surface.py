"""A plugin author's surface is ``kvbridge.plugin`` (and ``kvbridge.testkit`` in tests): the worked example
imports nothing else of kvbridge, so what it teaches is what the project promises to keep (issue 23 item 5: it
imported ``kvbridge.errors``, ``.geometry``, ``.slicing``, ``.state.base`` and ``.specs``)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvbridge.plugin

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ringbuffer-plugin"
ALLOWED = {"kvbridge.plugin", "kvbridge.testkit"}


def _kvbridge_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvbridge":
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names
                         if alias.name.split(".")[0] == "kvbridge")
    return found


def test_the_worked_example_imports_only_the_author_surface() -> None:
    sources = sorted(EXAMPLE.rglob("*.py"))
    assert sources, f"no example sources under {EXAMPLE}"
    wrong = [f"{path.relative_to(EXAMPLE)}:{line}: {module}" for path in sources
             for line, module, _ in _kvbridge_imports(path) if module not in ALLOWED]
    assert not wrong, "the example imports internal modules:\n" + "\n".join(wrong)


def test_every_name_the_example_takes_from_kvbridge_plugin_is_exported() -> None:
    missing = [f"{path.relative_to(EXAMPLE)}:{line}: {name}" for path in sorted(EXAMPLE.rglob("*.py"))
               for line, module, names in _kvbridge_imports(path) if module == "kvbridge.plugin"
               for name in names if name not in kvbridge.plugin.__all__]
    assert not missing, "names not in kvbridge.plugin.__all__:\n" + "\n".join(missing)


def test_the_plugin_api_page_names_every_export() -> None:
    import re

    import kvbridge.testkit

    page = (Path(__file__).resolve().parents[1] / "docs" / "plugin-api.md").read_text()
    missing = [f"{module.__name__}.{name}" for module in (kvbridge.plugin, kvbridge.testkit)
               for name in module.__all__ if not re.search(r"`[^`\n]*\b" + re.escape(name) + r"\b", page)]
    assert not missing, "docs/plugin-api.md does not name: " + ", ".join(missing)
