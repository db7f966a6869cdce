"""Shared set-up of the core tests.

pytest runs with ``--import-mode=importlib`` (several ``tests/`` directories live in one repo), which
does not put this directory on ``sys.path``; the helper module ``_kvcase`` is imported from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
