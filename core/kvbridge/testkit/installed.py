"""Run the backend kit against installed backends, without writing a test file::

    pytest --pyargs kvbridge.testkit.installed --kvbridge-backend nixl --kvbridge-backend mooncake

Without ``--kvbridge-backend`` every available installed backend runs. One test class per backend is
made here at import (``TestInstalled_<name>``); unavailable ones are listed as skipped with the reason.
"""

from __future__ import annotations

from kvbridge.testkit.backends import BackendTests
from kvbridge.testkit.checked import installed_registry


def _classes() -> dict[str, type]:
    out: dict[str, type] = {}
    for name in installed_registry().backend_names(available_only=False):
        cls_name = "TestInstalled_" + "".join(c if c.isalnum() else "_" for c in name)
        out[cls_name] = type(cls_name, (BackendTests,), {"backend": name, "__module__": __name__})
    return out


globals().update(_classes())
