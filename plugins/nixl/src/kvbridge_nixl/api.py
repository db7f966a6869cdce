"""NIXL's Python API module (``nixl._api``), loaded without importing torch where torch could not change it.

``import nixl`` picks the backend wheel (``nixl_cu12``, ``nixl_cu13``, ``nixl_rocm``) for the CUDA major version it
detects. With a CPU build of torch installed and not yet imported, that detection imports all of torch (about
4.5 CPU-s on a 2-core host, in every process that touches NIXL) only to learn that there is no CUDA, and then
takes the first backend wheel installed. :func:`load` takes that same wheel directly when the answer is known
without torch: no CUDA stack (torch, cuda-python, cupy) is imported yet and torch is either not installed or a
build without CUDA (read from its ``version.py`` on disk). In every other case, a CUDA host above all, it leaves
the choice to ``nixl`` itself.

Example::

    from kvbridge_nixl import api
    agent = api.load().nixl_agent("prefill-0", api.load().nixl_agent_config(backends=[]))
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load", "torch_build_has_cuda"]

#: the backend wheels, in the order ``nixl`` tries them when it detects no CUDA
BACKEND_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")
_CUDA_STACKS = ("torch", "cuda.bindings", "cupy")


def torch_build_has_cuda() -> bool | None:
    """Whether the installed torch was built with CUDA, read from its ``version.py`` without importing torch;
    False when torch is not installed, None when it cannot be told."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return False
    if not spec.origin:
        return None
    source = Path(spec.origin).parent / "version.py"
    namespace: dict[str, object] = {}
    try:
        exec(compile(source.read_text(), str(source), "exec"), namespace)
    except Exception:  # noqa: BLE001 - unreadable: let nixl decide
        return None
    return namespace.get("cuda") is not None


@functools.cache
def load() -> ModuleType:
    """``nixl._api``; raises what the import raised (ImportError when NIXL is not installed)."""
    if "nixl._api" in sys.modules:
        return sys.modules["nixl._api"]
    if not any(name in sys.modules for name in _CUDA_STACKS) and torch_build_has_cuda() is False:
        for wheel in BACKEND_WHEELS:
            try:
                return importlib.import_module(f"{wheel}._api")
            except ModuleNotFoundError as exc:
                if exc.name != wheel:
                    raise
    from nixl import _api
    return _api
