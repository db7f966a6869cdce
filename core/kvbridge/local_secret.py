"""Secure by default on one host: a secret that only this user's processes on this host can read.

With no secret configured (and no ``allow_insecure``), when every address a part of an engine binds or
advertises is this host's own (loopback, ``ipc://``), the ranks share a secret kept in a file only this user can
read, so prefill and decode engines of one user need no configuration and another local user's forged frames
have no effect::

    settings = load_settings().with_local_secret("127.0.0.1", "tcp://127.0.0.1:17600")
    settings.agent_config().secret       # the file's secret (the same in every rank of this user here)

The file is ``secret_file`` (``KVBRIDGE_SECRET_FILE``), else ``$XDG_RUNTIME_DIR/kvbridge/secret``, else
``~/.cache/kvbridge/secret``. The first rank to need it creates it: a complete file (mode 0600) is linked into
place (``link()`` fails when the name exists), so of ranks starting together exactly one creation wins and every
rank reads the winner's secret; the directory is created with mode 0700. A file that is a symbolic link (never
followed), not a regular file, owned by another user, readable or writable by group or others, or in a directory
others may replace it in, is refused with :class:`LocalSecretError` naming the path and the problem: kvbridge
never repairs, follows or replaces it.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from kvbridge.addresses import is_loopback
from kvbridge.errors import InsecureSetup

__all__ = ["FILE_ENV", "LocalSecretError", "all_local", "default_path", "read_or_create", "secret_path"]

log = logging.getLogger("kvbridge.local_secret")

FILE_ENV = "KVBRIDGE_SECRET_FILE"
MIN_CHARS = 32             # a secret file holding less is refused (a generated one holds 64 hex digits)
MAX_BYTES = 4096
_WAIT_S = 2.0              # a file another rank is still writing (no link() on this filesystem) is waited for
_logged: set[str] = set()
_logged_lock = threading.Lock()


class LocalSecretError(InsecureSetup):
    """The host-local secret file cannot be used safely (the message names the path and why): the engine does
    not start rather than run without a secret."""


def is_local_address(address: str) -> bool:
    """``ipc://``/``inproc://``, or a host, ``host:port`` or URL whose host is loopback. Anything else, an
    unspecified address (0.0.0.0) or one that cannot be read, is not."""
    text = address.strip()
    if text.startswith(("ipc://", "inproc://")) or is_loopback(text):     # is_loopback: a bare host (``::1``)
        return True
    try:
        host = urlsplit(text if "://" in text else "//" + text).hostname
    except ValueError:
        return False
    return bool(host) and is_loopback(host or "")


def all_local(addresses: Iterable[str]) -> bool:
    """Every address is this host's own; False for none at all (nothing to judge by)."""
    seen = [a for a in addresses if a is not None]
    return bool(seen) and all(is_local_address(str(a)) for a in seen)


def default_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/kvbridge/secret`` (when it names an existing absolute directory), else
    ``~/.cache/kvbridge/secret``."""
    env = os.environ if env is None else env
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "kvbridge" / "secret"
    home = env.get("HOME", "")
    return Path(home if os.path.isabs(home) else os.path.expanduser("~")) / ".cache" / "kvbridge" / "secret"


def secret_path(configured: str, env: Mapping[str, str] | None = None) -> Path:
    """The file: ``configured`` (``~`` expanded; must then be absolute) or :func:`default_path`."""
    if not configured:
        return default_path(env)
    path = Path(os.path.expanduser(configured))
    if not path.is_absolute():
        raise LocalSecretError(f"secret_file={configured!r}: must be an absolute path (every rank reads the same "
                               "file, whatever its working directory)")
    return path


# ---------------------------------------------------------------------------------------------- the file
def _problem(st: os.stat_result, what: str) -> str:
    """Why a file or directory with this status is unsafe to hold our secret, or ""."""
    me = os.geteuid()
    if st.st_uid not in (me, 0) or (what == "file" and st.st_uid != me):
        return f"is owned by uid {st.st_uid}, not by this user (uid {me})"
    if what == "file":
        if st.st_mode & 0o077:
            return (f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may read or change it "
                    "(chmod 600 it if its secret never left this user, else delete it)")
        return ""
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may replace the file in it"
    return ""


def _check_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(directory)
    except OSError as exc:
        raise LocalSecretError(f"local secret directory {directory}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LocalSecretError(f"local secret directory {directory}: not a directory")
    why = _problem(st, "directory")
    if why:
        raise LocalSecretError(f"local secret directory {directory} {why}; refusing to use the secret file in it")


def _read(path: Path) -> str | None:
    """The file's secret, None while it is empty; FileNotFoundError when absent. Never follows a symbolic
    link, never blocks on a FIFO, and checks the opened file itself (not the name)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LocalSecretError(f"local secret file {path} is a symbolic link: refused (never followed); "
                                   "remove it") from None
        raise LocalSecretError(f"local secret file {path}: cannot open it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocalSecretError(f"local secret file {path} is not a regular file: refused")
        why = _problem(st, "file")
        if why:
            raise LocalSecretError(f"local secret file {path} {why}; refused")
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise LocalSecretError(f"local secret file {path} holds more than {MAX_BYTES} bytes: not a secret file")
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        raise LocalSecretError(f"local secret file {path} is not UTF-8 text") from None
    if not text:
        return None
    if "\0" in text:
        raise LocalSecretError(f"local secret file {path} holds a NUL byte: not a secret file (delete it and a new "
                               "one is made)")
    if len(text) < MIN_CHARS:
        raise LocalSecretError(f"local secret file {path} holds {len(text)} characters, fewer than {MIN_CHARS}: "
                               "too weak (delete it and a new one is made)")
    return text


def _create(path: Path) -> None:
    """Make the file unless it exists: a complete temporary file, linked to ``path`` (fails if taken)."""
    body = (secrets.token_hex(32) + "\n").encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    excl = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        _write_private(os.open(tmp, excl, 0o600), body)
        try:
            os.link(tmp, path, follow_symlinks=False)
        except FileExistsError:
            return                                         # another rank (or a planted name) was first
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS):
                raise
            _create_in_place(path, body, excl)             # no hard links here: exclusive create, then write
    except OSError as exc:
        raise LocalSecretError(f"local secret file {path}: cannot create it: {exc.strerror or exc}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _create_in_place(path: Path, body: bytes, excl: int) -> None:
    try:
        fd = os.open(path, excl, 0o600)
    except FileExistsError:
        return
    _write_private(fd, body)


def _write_private(fd: int, body: bytes) -> None:
    """Write ``body`` to the new file ``fd`` (mode 0600 whatever the umask), sync and close it."""
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_or_create(path: Path) -> str:
    """The secret in ``path``, made first if absent (race-safe: every caller gets the same one)."""
    _check_dir(path.parent)
    deadline = time.monotonic() + _WAIT_S
    for _ in range(1000):
        try:
            text = _read(path)
        except FileNotFoundError:
            _create(path)
            continue
        if text is not None:
            return text
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)                                  # being written by another rank (no link() here)
    raise LocalSecretError(f"local secret file {path} stays empty: delete it and a new one is made")


def local_secret(*, configured: str, allow_insecure: bool, secret_file: str, addresses: Iterable[str],
                 env: Mapping[str, str] | None = None) -> str | None:
    """The host-local secret when it applies (no ``configured`` secret, no ``allow_insecure``, every address
    this host's own), else None. Logs once per process and file that it is used (the path, never the secret)."""
    if configured or allow_insecure or not all_local(addresses):
        return None
    path = secret_path(secret_file, env)
    try:
        text = read_or_create(path)
    except LocalSecretError as exc:
        raise LocalSecretError(f"{exc}. Other ways: another file ({FILE_ENV}, secret_file=), a secret of your "
                               "own (KVBRIDGE_SECRET, secret=) on every part, or none on loopback "
                               "(KVBRIDGE_ALLOW_INSECURE=1 on every part)") from None
    with _logged_lock:
        first = str(path) not in _logged
        _logged.add(str(path))
    if first:
        log.info("kvbridge: no secret configured and every address is on this host: using the local secret file "
                 "%s (only this user can read it; every rank of this user here shares it)", path)
    return text
