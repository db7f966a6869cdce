"""Backend options (``options=`` of the factory, ``backend_options`` of the settings), and a CMA self-test.

UCX settings reach the agent's UCX backend through NIXL's own API, never through this process's
environment: the UCX plugin's ``engine_config`` parameter (``KEY=VALUE,KEY=VALUE``, the names without
``UCX_``) is applied to that backend's UCX context only. NIXL lets the environment win: a ``UCX_TLS`` (or
any ``UCX_*``) set in the environment overrides the option (NIXL logs "UCX env var already set"), so
what the user exported for the whole process still rules.

UCX moves host memory between two processes of one host with CMA (``process_vm_writev``), which needs
ptrace permission between them. UCX 1.23 (bundled with nixl 1.5.1) tests CMA on itself and honours Yama
``ptrace_scope``, falling back to TCP on its own; where a policy it cannot see still blocks it (an LSM, a
seccomp rule that differs between the peers), transfers fail with ``NIXL_ERR_BACKEND``. The fix is to pin
the transport: ``options={"ucx_tls": "tcp"}`` (or ``UCX_TLS=tcp`` in the environment).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from kvbridge.plugin import SettingsError, parse_options


class NixlOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The NIXL backend's options (every value may arrive as a string)."""

    ucx_tls: Annotated[str, msgspec.Meta(description=(
        "UCX transports of this backend's agent (`tcp`, `cma,tcp`...); empty: UCX's choice. `UCX_TLS` in the "
        "environment wins"))] = ""
    ucx_config: Annotated[str, msgspec.Meta(description=(
        "more UCX settings for this agent only, `KEY=VALUE,KEY=VALUE` (e.g. `RNDV_THRESH=8k`; `UCX_` "
        "optional); `UCX_*` in the environment wins"))] = ""
    num_threads: Annotated[int, msgspec.Meta(ge=0, description="UCX worker threads; 0: NIXL's default")] = 0
    sync_mode: Annotated[Literal["none", "rw", "strict"], msgspec.Meta(description=(
        "NIXL agent locking: `rw` (transfers posted from several threads), `strict` or `none`"))] = "rw"
    progress_thread: Annotated[bool, msgspec.Meta(description="NIXL's progress thread")] = True

    @classmethod
    def parse(cls, options: Mapping[str, object] | None) -> NixlOptions:
        """Refuses unknown keys (naming the closest known one) and values of the wrong type (SettingsError,
        a ValueError)."""
        parsed = parse_options(cls, options, "nixl option")
        parsed.ucx_settings()    # checks ucx_config's syntax
        return parsed

    def ucx_settings(self) -> dict[str, str]:
        """UCX settings for the agent's UCX backend, without the ``UCX_`` prefix (``{"TLS": "tcp"}``)."""
        out: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in self.ucx_config.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().upper()
            key = key[4:] if key.startswith("UCX_") else key
            if not sep or not key:
                raise SettingsError(f"nixl option ucx_config={self.ucx_config!r}: expected KEY=VALUE pairs "
                                    "separated by commas")
            out[key] = value.strip()
        if self.ucx_tls:
            out["TLS"] = self.ucx_tls
        return out

    def engine_config(self, extra_tls: str = "") -> str:
        """The UCX plugin's ``engine_config`` parameter (``TLS=tcp,RNDV_THRESH=8k``); ``extra_tls`` is
        appended to a pinned transport list."""
        settings = self.ucx_settings()
        if extra_tls and "TLS" in settings:
            settings["TLS"] += f",{extra_tls}"
        return ",".join(f"{key}={value}" for key, value in settings.items())

    def overridden_by_environment(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The UCX settings of these options that the environment overrides (``{"UCX_TLS": "cma"}``)."""
        environ = os.environ if environ is None else environ
        return {f"UCX_{key}": environ[f"UCX_{key}"] for key, value in self.ucx_settings().items()
                if f"UCX_{key}" in environ and environ[f"UCX_{key}"] != value}


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cma_blocked() -> str:
    """Why CMA cannot work in this process (empty when the self-test passes; Linux only).

    Runs ``process_vm_readv`` on this process, as UCX does, and reads Yama's ``ptrace_scope``.
    """
    if not sys.platform.startswith("linux"):
        return ""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        scope = "0"
    if scope == "3":
        return "Yama ptrace_scope=3 forbids cross-process memory access"
    libc = ctypes.CDLL(None, use_errno=True)
    readv = getattr(libc, "process_vm_readv", None)
    if readv is None:
        return "libc has no process_vm_readv"
    src, dst = ctypes.create_string_buffer(b"kvbridge", 8), ctypes.create_string_buffer(8)
    local, remote = _IoVec(ctypes.addressof(dst), 8), _IoVec(ctypes.addressof(src), 8)
    if readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != 8:
        return f"process_vm_readv on itself failed: {os.strerror(ctypes.get_errno())}"
    return ""
