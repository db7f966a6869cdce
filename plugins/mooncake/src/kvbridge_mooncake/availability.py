"""Is Mooncake usable here? Cheap checks first (system library, package), then the real import."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType

from kvbridge.plugin import Availability, env_defaults

APT_HINT = "apt-get install -y --no-install-recommends libibverbs1"
PIP_HINT = "pip install mooncake-transfer-engine-non-cuda"
_CUDA_HINT = ("this is the CUDA build of Mooncake; install the CUDA runtime, or on a CPU-only host: "
              "pip uninstall -y mooncake-transfer-engine && " + PIP_HINT)


#: Mooncake logs every connection at INFO; it reads ``MC_LOG_LEVEL`` once, when ``mooncake.engine`` is loaded
#: (0.3.13: ``GLOG_minloglevel`` has no effect). Set for the import only, and only when the user has not.
QUIET = {"MC_LOG_LEVEL": "WARNING"}


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """``MC_LOG_LEVEL=WARNING`` while ``mooncake.engine`` loads, unless the environment sets it; the process
    environment is as before afterwards."""
    with env_defaults(QUIET):
        yield


def load_engine_module() -> ModuleType:
    """``import mooncake.engine`` with :func:`quiet_import` (an ImportError propagates)."""
    with quiet_import():
        return importlib.import_module("mooncake.engine")


def has_libibverbs() -> bool:
    """The engine links libibverbs.so.1 even for TCP; without it ``import mooncake.engine`` fails."""
    if ctypes.util.find_library("ibverbs"):
        return True
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return False
    return True


def hint_for(error: BaseException) -> str:
    """The install command that fixes an ImportError of ``mooncake.engine``."""
    text = str(error)
    if "libibverbs" in text:
        return APT_HINT
    if "libcudart" in text or "libcuda" in text:
        return _CUDA_HINT
    return PIP_HINT


def probe() -> Availability:
    if importlib.util.find_spec("mooncake") is None:
        hint = PIP_HINT if has_libibverbs() else f"{APT_HINT} && {PIP_HINT}"
        return Availability.missing("the mooncake transfer engine is not installed", hint)
    if not has_libibverbs():
        return Availability.missing("libibverbs.so.1 is missing (Mooncake links it even for TCP)", APT_HINT)
    try:
        load_engine_module()      # the probe's whole point is whether this loads
    except Exception as exc:  # noqa: BLE001 - any failure to load means "unavailable", with its text
        reason = f"cannot import mooncake.engine: {type(exc).__name__}: {exc}"
        return Availability.missing(reason, hint_for(exc))
    return Availability.ok()
