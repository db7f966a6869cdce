"""kvbridge's conformance kit against the ascend backend over its in-process stand-in of memfabric's
TransferEngine (basic tier; the stand-in declares neither multi-process nor device memory)."""

from __future__ import annotations

from kvbridge.testkit import BackendTests
from kvbridge_ascend.testing import STANDIN_SPEC


class TestAscendStandInConformance(BackendTests):
    spec = STANDIN_SPEC
