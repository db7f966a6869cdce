"""The pluggy markers and names (internal; plugin authors import them from :mod:`kvbridge.plugin`).

Kept apart so that core modules can mark hook implementations without importing the whole author surface.
"""

from __future__ import annotations

import pluggy

PROJECT = "kvbridge"
ENTRY_POINT_GROUP = "kvbridge"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
