"""pytest runs with ``--import-mode=importlib``: put this directory on ``sys.path`` for ``_vllmrig``."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
