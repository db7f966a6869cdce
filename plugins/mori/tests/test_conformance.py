"""kvbridge's conformance kit against the mori backend over its in-process stand-in of ``mori.io``
(basic tier; the stand-in declares neither multi-process nor GPU memory, so those tiers are skipped)."""

from __future__ import annotations

from kvbridge.testkit import BackendTests
from kvbridge_mori.testing import STANDIN_SPEC


class TestMoriStandInConformance(BackendTests):
    spec = STANDIN_SPEC
    # the stand-in keeps every IOEngine (and its worker thread) in a module registry until standin.reset(),
    # so MoriBackend.close() cannot end the thread; a real engine is destroyed with its last reference
    leak_allowed_threads = ("mori-standin-",)
