"""memfabric return codes (``smem.h`` of memfabric-hybrid 1.3.0) and how kvbridge names them."""

from __future__ import annotations

import enum


class SmemCode(enum.IntEnum):
    """What memfabric's C API returns; 0 is success. Many Python-level failures are plain -1."""

    OK = 0
    ERROR = -1
    INVALID_PARAM = -2000
    MALLOC_FAILED = -2001
    NO_RESOURCES = -2002
    NOT_STARTED = -2003
    TIMEOUT = -2004
    REPEAT_INVOKE = -2005
    DUPLICATED = -2006
    NOT_EXIST = -2007
    NOT_INIT = -2008
    RES_IN_USE = -2009
    PARTIAL_FAILED = -2012
    NOT_CONNECTED = -2014
    BUFFER_TOO_SMALL = -2015


def describe(rc: int) -> str:
    """``-2007`` -> ``"-2007 (SMEM_NOT_EXIST)"``; unknown codes are shown bare."""
    try:
        return f"{rc} (SMEM_{SmemCode(rc).name})"
    except ValueError:
        return str(rc)
