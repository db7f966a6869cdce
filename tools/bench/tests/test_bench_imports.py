"""kvbridge-bench imports kvbridge's public modules only, plus the internals ``kvbridge_bench._internals`` names
(the one place they are imported), and no plugin package: a backend is built by name through the registry, and
the raw NIXL baseline uses NIXL's own API."""

from __future__ import annotations

import ast
from pathlib import Path

import kvbridge_bench
import kvbridge_bench._internals

PACKAGE = Path(kvbridge_bench.__file__).resolve().parent
PUBLIC = {"kvbridge", "kvbridge.agent", "kvbridge.plugin"}
#: What _internals may import, and why is in its docstring; a new internal must be added there and here.
INTERNALS = {"kvbridge.digests", "kvbridge.hostpool", "kvbridge.registry", "kvbridge.shmnames", "kvbridge.specs",
             "kvbridge.staging", "kvbridge.protocol.wire"}


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno))
    return found


def test_only_public_kvbridge_modules_outside_internals() -> None:
    bad = [f"{path.name}:{line} imports {name}" for path in sorted(PACKAGE.glob("*.py")) if path.name != "_internals.py"
           for name, line in _imports(path) if name.split(".")[0] == "kvbridge" and name not in PUBLIC]
    assert bad == [], "\n".join(bad)


def test_internals_imports_exactly_the_listed_modules() -> None:
    names = {name for name, _ in _imports(PACKAGE / "_internals.py") if name.split(".")[0] == "kvbridge"}
    assert names == INTERNALS
    doc = kvbridge_bench._internals.__doc__ or ""
    for name in kvbridge_bench._internals.__all__:
        assert f"``{name}``" in doc, f"{name}: say in _internals' docstring why it is needed"


def test_no_plugin_package_is_imported() -> None:
    bad = [f"{path.name}:{line} imports {name}" for path in sorted(PACKAGE.glob("*.py"))
           for name, line in _imports(path)
           if name.split(".")[0].startswith("kvbridge_") and name.split(".")[0] != "kvbridge_bench"]
    assert bad == [], "\n".join(bad)
