"""Backend options (``options=`` of the factory), the UCX environment they imply, and a CMA self-test.

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
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

_SYNC_MODES = ("none", "rw", "strict")
_ENV_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class NixlOptions:
    """Parsed ``options``. Every value arrives as a string.

    ``ucx_tls``: pin UCX's transports for this backend's agent (``"tcp"``, ``"cma,tcp"``...); empty = UCX's
    choice. ``num_threads``: UCX worker threads (0 = NIXL default). ``sync_mode``: NIXL agent locking,
    ``rw`` (default: transfers may be posted from several threads), ``strict`` or ``none``.
    ``progress_thread``: ``1`` (default) or ``0``.
    """

    ucx_tls: str = ""
    num_threads: int = 0
    sync_mode: str = "rw"
    progress_thread: bool = True

    @classmethod
    def parse(cls, options: Mapping[str, str] | None) -> NixlOptions:
        opts = dict(options or {})
        known = {"ucx_tls", "num_threads", "sync_mode", "progress_thread"}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"unknown nixl option(s) {unknown}; known: {sorted(known)}")
        sync = opts.get("sync_mode", "rw").lower()
        if sync not in _SYNC_MODES:
            raise ValueError(f"nixl option sync_mode={sync!r}: expected one of {_SYNC_MODES}")
        try:
            threads = int(opts.get("num_threads", "0"))
        except ValueError:
            raise ValueError(f"nixl option num_threads={opts['num_threads']!r} is not an integer") from None
        if threads < 0:
            raise ValueError(f"nixl option num_threads={threads} is negative")
        progress = opts.get("progress_thread", "1").lower()
        if progress not in ("0", "1", "true", "false"):
            raise ValueError(f"nixl option progress_thread={progress!r}: expected 1 or 0")
        return cls(opts.get("ucx_tls", "").strip(), threads, sync, progress in ("1", "true"))

    @property
    def env(self) -> dict[str, str]:
        """Environment UCX must see while the agent is created."""
        return {"UCX_TLS": self.ucx_tls} if self.ucx_tls else {}


@contextmanager
def scoped_env(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set ``overrides`` in ``os.environ`` for the duration (serialised: the environment is process-wide).

    UCX reads ``UCX_*`` variables when a NIXL agent creates its UCX backend, so an override scoped to the
    agent's construction pins that agent only.
    """
    if not overrides:
        yield
        return
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


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
