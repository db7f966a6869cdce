"""Is Mooncake usable here? Cheap checks first (system library, package), then the real import."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os

from kvbridge.plugin import Availability

APT_HINT = "apt-get install -y --no-install-recommends libibverbs1"
PIP_HINT = "pip install mooncake-transfer-engine-non-cuda"
_CUDA_HINT = ("this is the CUDA build of Mooncake; install the CUDA runtime, or on a CPU-only host: "
              "pip uninstall -y mooncake-transfer-engine && " + PIP_HINT)


def quiet_glog() -> None:
    """Mooncake logs every connection at INFO through glog; default to warnings and up."""
    os.environ.setdefault("GLOG_minloglevel", "1")


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
    quiet_glog()
    try:
        import mooncake.engine  # noqa: F401 - the probe's whole point is whether this loads
    except Exception as exc:  # noqa: BLE001 - any failure to load means "unavailable", with its text
        reason = f"cannot import mooncake.engine: {type(exc).__name__}: {exc}"
        return Availability.missing(reason, hint_for(exc))
    return Availability.ok()
