"""Selecting kvbridge in an unmodified SGLang: ``--disaggregation-transfer-backend kvbridge``.

SGLang loads every function registered under the entry-point group ``sglang.srt.plugins`` early in each
of its processes (launcher, engine, scheduler, ...), before it parses its arguments. kvbridge-sglang
registers :func:`register` there, which

1. adds ``"kvbridge"`` to SGLang's transfer-backend choices (``add_disagg_transfer_backend_choices``);
2. adds a ``KVBRIDGE = "kvbridge"`` member to SGLang's closed ``TransferBackend`` enum, so
   ``TransferBackend("kvbridge")`` resolves everywhere SGLang converts the flag;
3. wraps ``sglang.srt.disaggregation.utils.get_kv_class`` with an AROUND hook of SGLang's own
   ``HookRegistry`` (which rebinds every module that imported the function) so that the kvbridge backend
   yields this package's manager, sender, receiver and bootstrap server; every other backend is untouched.

``SGLANG_PLUGINS`` (SGLang's allow-list) must include ``kvbridge`` when it is set. ``install()`` does the
same in a process that never calls SGLang's ``load_plugins`` (tests, notebooks).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvbridge.sglang")

BACKEND = "kvbridge"
_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def extend_enum(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add member ``name = value`` to the enum ``cls`` (idempotent); returns the member."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls               # type: ignore[attr-defined]
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    type.__setattr__(cls, name, member)
    return member


def _classes() -> dict[Any, Any]:
    from sglang.srt.disaggregation.utils import KVClassType

    from kvbridge_sglang.conn import (
        KVBridgeKVBootstrapServer,
        KVBridgeKVManager,
        KVBridgeKVReceiver,
        KVBridgeKVSender,
    )

    return {KVClassType.MANAGER: KVBridgeKVManager, KVClassType.SENDER: KVBridgeKVSender,
            KVClassType.RECEIVER: KVBridgeKVReceiver, KVClassType.BOOTSTRAP_SERVER: KVBridgeKVBootstrapServer}


def get_kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """The AROUND hook: kvbridge's classes for the kvbridge backend, SGLang's for every other."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    return _classes().get(class_type)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (SGLang's ``load_plugins`` applies the hook right after)."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    extend_enum(TransferBackend, "KVBRIDGE", BACKEND)
    if not any(fn is get_kv_class_hook for _, fn, _ in HookRegistry._hooks.get(_TARGET, [])):
        HookRegistry.register(_TARGET, get_kv_class_hook, HookType.AROUND)
    log.debug("kvbridge-sglang: transfer backend %r registered", BACKEND)


def install() -> None:
    """``register()`` and apply the hook now, for processes that do not run SGLang's ``load_plugins``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
