"""Parent-side plumbing shared by the child-process rigs (``_churnrig``, ``_faultrig``): a Python child
running a rig script, whose ``<TAG>{json}`` stdout lines are read by a thread and handed to the rig as
events; commands go to its stdin as JSON lines; its stderr goes to a temporary file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class TaggedChild:
    """One child process. A subclass sets up what ``_event`` and ``_eof`` use before calling ``__init__``."""

    def __init__(self, label: str, script: Path, tag: str, argv: Sequence[str] = (),
                 env_defaults: Mapping[str, str] | None = None) -> None:
        self.label = label
        self._tag = tag
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1")
        for key, value in (env_defaults or {}).items():
            env.setdefault(key, value)
        self.proc = subprocess.Popen([sys.executable, str(script), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"{tag.strip().lower()}-{label}", daemon=True)
        self._reader.start()

    def _event(self, item: dict[str, Any]) -> None:
        """One event line of the child (called by the reader thread)."""
        raise NotImplementedError

    def _eof(self) -> None:
        """The child's stdout closed (called by the reader thread)."""

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            for raw in out:
                text = raw.decode(errors="replace").rstrip("\n")
                if text.startswith(self._tag):
                    self._event(json.loads(text[len(self._tag):]))
        except (OSError, ValueError):
            pass
        finally:
            self._eof()

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def stderr(self) -> str:
        try:
            self.log.seek(0)
            return self.log.read().decode(errors="replace")[-3000:]
        except (OSError, ValueError):
            return "<closed>"

    def _close_pipes(self) -> None:
        """Close stdin and stdout and let the reader thread finish (teardown, after the child is gone)."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self._reader.join(timeout=5)
