"""Markers for plugin authors: ``from kvbridge.plugin import hookimpl``."""

from __future__ import annotations

import pluggy

PROJECT = "kvbridge"
ENTRY_POINT_GROUP = "kvbridge"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
