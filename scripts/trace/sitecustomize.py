"""Timeline trace of the staged path, for ``scripts/probe_latency.py`` (issue 14's measurements).

Active only when this directory is on ``PYTHONPATH`` and ``PROBE_TRACE`` names a directory: every process
(the probe and its rank processes) appends ``<perf_counter> <step>> | <step>< <detail>`` lines to
``$PROBE_TRACE/trace-<pid>.txt`` around ``send()``, each gather, each write, each write's completion check,
each notice and each count on the decode, and the benchmark's request. ``perf_counter`` is the host's
monotonic clock, so the files of one host merge into one timeline (``analyze.py``)::

    PROBE_TRACE=/tmp/tr PYTHONPATH=scripts/trace:core:plugins/nixl/src:tools/bench/src PROBE_PLUGINS=kvbridge_nixl \\
        python3 scripts/probe_latency.py cuda sweep 6 scattered
    python3 scripts/trace/analyze.py /tmp/tr "1 GiB scattered"
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TextIO

_OUT = os.environ.get("PROBE_TRACE")
_file: TextIO | None = None


def _event(name: str, detail: str) -> None:
    global _file
    if _file is None:
        _file = open(f"{_OUT}/trace-{os.getpid()}.txt", "a", buffering=1)   # one file per process, open until exit
    _file.write(f"{time.perf_counter():.6f} {name} {detail}\n")


def _wrap(cls: type, method: str, detail: Callable[..., str] | None = None, result: bool = False) -> None:
    inner = getattr(cls, method)

    @functools.wraps(inner)
    def traced(*args: Any, **kwargs: Any) -> Any:
        text = detail(*args, **kwargs) if detail is not None else ""
        _event(method + ">", text)
        value = inner(*args, **kwargs)
        _event(method + "<", f"{text} r={value}" if result else text)
        return value

    setattr(cls, method, traced)


def _patch(bench: ModuleType) -> None:
    from kvbridge.agent import decode, posting, prefill

    _wrap(prefill.PrefillSide, "send")
    _wrap(posting.Poster, "_gather", lambda _s, p: f"chunk={p.notice.chunk}")   # decides; the copy runs after
    _wrap(posting.Poster, "_send", lambda _s, _room, _t, _agent, notice, *_a: f"chunk={notice.chunk}")
    _wrap(posting.Poster, "_posted", lambda _s, _room, item, *_a: f"chunk={item.notice.chunk}")   # the backend took it
    _wrap(prefill.PrefillSide, "_finished", lambda _s, _room, item, done, _reason: f"chunk={item.notice.chunk} "
                                                                                   f"done={done}")
    _wrap(decode.DecodeSide, "on_notice", lambda _s, notice, _env: f"chunk={notice.chunk}")
    _wrap(decode.DecodeSide, "_count", lambda _s, _room, _key, notice, _layers: f"chunk={notice.chunk}")
    _wrap(bench._Rank, "op_recv")
    _wrap(bench._Rank, "go_whole")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``kvbridge_bench.transfer`` (and the agent it drives) as it is first imported."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != "kvbridge_bench.transfer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            sys.modules[name] = module
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _OUT:
    sys.meta_path.insert(0, _PatchOnImport())
