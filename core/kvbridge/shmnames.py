"""Names of /dev/shm segments: the grammar a segment name must follow, and this run's tag.

/dev/shm is host-wide. Segments kvbridge creates for its demo and test kit are named
``kvbridge-<kind>-<run tag>-<pid>-<n>``: the run tag is random per run (kept in the environment
variable ``KVBRIDGE_SHM_RUN`` so that child processes started after this module is imported share
it), so a leak check or a reaper looks at its own run's segments only and never at another run's on
the same host.

    segment_prefix("demo")          # 'kvbridge-demo-3f9a0c21-'
    is_segment_name("../../etc/x")  # False: a name from a peer is checked before it is opened
"""

from __future__ import annotations

import os
import re
import secrets
from typing import TypeGuard

__all__ = ["MAX_SEGMENT_NAME", "RUN_ENV", "RUN_TAG", "is_segment_name", "segment_prefix"]

RUN_ENV = "KVBRIDGE_SHM_RUN"
MAX_SEGMENT_NAME = 200
_TAG = re.compile(r"[a-z0-9]{4,16}")
#: one path component under /dev/shm: no "/", no leading dot (so neither "." nor ".."), bounded
_SEGMENT_NAME = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_SEGMENT_NAME - 1}}}")


def is_segment_name(name: object) -> TypeGuard[str]:
    """True for a plain segment name: ``[A-Za-z0-9._-]``, not starting with a dot, 1 to MAX_SEGMENT_NAME long."""
    return isinstance(name, str) and _SEGMENT_NAME.fullmatch(name) is not None


def _run_tag() -> str:
    tag = os.environ.get(RUN_ENV, "")
    if not _TAG.fullmatch(tag):
        tag = secrets.token_hex(4)
        os.environ[RUN_ENV] = tag
    return tag


#: this run's tag: inherited from a parent process of this run, else fresh
RUN_TAG = _run_tag()


def segment_prefix(kind: str) -> str:
    """``kvbridge-<kind>-<run tag>-``: the prefix of this run's segments of ``kind`` (a name goes on with
    ``<pid>-<n>``)."""
    if not re.fullmatch(r"[a-z]{1,16}", kind):
        raise ValueError(f"segment kind={kind!r} must be 1 to 16 lowercase letters")
    return f"kvbridge-{kind}-{RUN_TAG}-"
