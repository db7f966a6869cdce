"""The stand-in against the real memfabric_hybrid module, which imports on this host.

Signatures come from the pybind11 docstrings (``name(self: T, a: T, b: T = default) -> R``), since
``inspect.signature`` cannot read builtins. Behaviour that can be observed without an NPU driver is
compared by running the same calls on both engines (the real one in a subprocess, to keep its native
state out of the test process).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
from typing import Any

import pytest

from kvbridge_ascend import standin

real = pytest.importorskip("memfabric_hybrid", reason="memfabric-hybrid is not installed")
_ENUM_DEFAULT = re.compile(r"^<(\w+)\.(\w+): (-?\d+)>$")


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[(<"
        depth -= ch in "])>"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def pybind_params(func: Any) -> list[tuple[str, object]]:
    """(name, default) after ``self`` from a pybind11 docstring; default ``inspect.Parameter.empty`` if none."""
    first = (func.__doc__ or "").strip().splitlines()[0]
    inner = first[first.index("(") + 1: first.rindex(") ->")]
    params: list[tuple[str, object]] = []
    for part in _split_top(inner):
        name, _, rest = part.partition(":")
        _, eq, default = rest.partition(" = ")
        if not eq:
            params.append((name.strip(), inspect.Parameter.empty))
            continue
        enum_default = _ENUM_DEFAULT.match(default.strip())
        params.append((name.strip(), enum_default.group(2) if enum_default else ast.literal_eval(default.strip())))
    return params[1:] if params and params[0][0] == "self" else params


def standin_params(func: Any) -> list[tuple[str, object]]:
    out = []
    for p in list(inspect.signature(func).parameters.values()):
        if p.name == "self":
            continue
        default = p.default.name if hasattr(p.default, "name") else p.default
        out.append((p.name, default))
    return out


def _public(cls: Any) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))} - {
        "TransDataOpType", "TransferOpcode"}


def test_transfer_engine_methods_match_by_name() -> None:
    assert _public(real.TransferEngine) == _public(standin.TransferEngine)


@pytest.mark.parametrize("method", sorted(_public(real.TransferEngine)))
def test_transfer_engine_signatures_match(method: str) -> None:
    want = pybind_params(getattr(real.TransferEngine, method))
    assert standin_params(getattr(standin.TransferEngine, method)) == want


def test_module_level_create_config_store_matches() -> None:
    assert standin_params(standin.create_config_store) == pybind_params(real.create_config_store) == [
        ("store_url", inspect.Parameter.empty)]


@pytest.mark.parametrize("enum_name", ["TransDataOpType", "TransferOpcode"])
def test_enums_match_by_name_and_value(enum_name: str) -> None:
    want = {name: int(value) for name, value in getattr(real, enum_name).__members__.items()}
    assert {m.name: m.value for m in getattr(standin, enum_name)} == want
    assert getattr(real.TransferEngine, enum_name) is getattr(real, enum_name)
    assert getattr(standin.TransferEngine, enum_name) is getattr(standin, enum_name)


_PROBE = """
import json, sys
api = __import__(sys.argv[1], fromlist=["TransferEngine"])
te = api.TransferEngine()
out = {
    "rpc_port_before_init": te.get_rpc_port(),
    "register_mismatch": int(te.batch_register_memory([4096, 8192], [64])),
    "register_before_init": int(te.batch_register_memory([4096], [64])),
    "unregister_before_init": int(te.unregister_memory(4096)),
    "write_before_init": int(te.batch_transfer_sync_write("127.0.0.1:1", [4096], [8192], [8])),
    "bad_role": int(te.initialize("tcp://127.0.0.1:1", "127.0.0.1:2", "Bogus", 0)),
}
print("RESULT " + json.dumps(out))
"""


def _observe(module: str) -> dict[str, int]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True, text=True, timeout=60)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_observable_behaviour_matches_without_a_driver() -> None:
    assert _observe("kvbridge_ascend.standin") == _observe("memfabric_hybrid")


def test_the_backend_drives_the_real_initialize_and_reports_its_failure(tmp_path: Any) -> None:
    code = ("from kvbridge_ascend.backend import AscendBackend\n"
            "from kvbridge.errors import PluginUnavailableError\n"
            "try:\n"
            "    AscendBackend(name='real', options={'store_url': 'tcp://127.0.0.1:1', 'host': '127.0.0.1'})\n"
            "except PluginUnavailableError as exc:\n"
            "    print('UNAVAILABLE', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("UNAVAILABLE"))
    if importlib.import_module("kvbridge_ascend").DRIVER_DIR.is_dir():
        pytest.skip("an NPU driver is present; initialize may succeed here")
    assert "TransferEngine.initialize(store 'tcp://127.0.0.1:1'" in line and "returned -1" in line
