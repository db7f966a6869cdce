"""kvbridge's threads in a vLLM worker: started inside ``unpinned()`` they may run on every allowed CPU even
when the starting thread is pinned to one (as vLLM's CPU workers are), and the caller's own mask comes back."""

from __future__ import annotations

import os
import threading

import pytest

from kvbridge_vllm.threads import _parse_cpu_list, allowed_cpus, unpinned

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs sched_setaffinity and at least 2 CPUs")


def test_parse_cpu_list() -> None:
    assert _parse_cpu_list("0-3,6,8-9") == {0, 1, 2, 3, 6, 8, 9}
    assert _parse_cpu_list("5") == {5}


def test_threads_started_inside_are_not_pinned() -> None:
    seen: dict[str, set[int]] = {}

    def pinned_worker() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})     # what vLLM does to its worker thread
        mine = os.sched_getaffinity(0)

        def probe(name: str) -> None:
            seen[name] = os.sched_getaffinity(0)

        t = threading.Thread(target=probe, args=("outside",))
        t.start()
        t.join()
        with unpinned():
            t = threading.Thread(target=probe, args=("inside",))
            t.start()
            t.join()
        seen["after"] = os.sched_getaffinity(0)
        seen["pinned"] = mine

    t = threading.Thread(target=pinned_worker)
    t.start()
    t.join()
    assert len(seen["outside"]) == 1, "the premise: threads inherit their starter's mask"
    assert seen["inside"] == allowed_cpus() & os.sched_getaffinity(0) or len(seen["inside"]) > 1
    assert seen["after"] == seen["pinned"], "the starting thread's own mask was not restored"
