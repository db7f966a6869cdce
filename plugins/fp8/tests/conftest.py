"""Make this directory's helper module importable under ``--import-mode=importlib`` (the repo default)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
