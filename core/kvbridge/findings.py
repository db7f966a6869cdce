"""What a host check found: the records ``kvbridge doctor`` prints, and that a plugin's ``diagnose`` returns.

    from kvbridge.findings import Finding, Severity

    def diagnose():                                   # BackendSpec(..., diagnose="my_pkg.checks:diagnose")
        yield Finding(severity=Severity.WARNING, check="mybackend", text="no RDMA device: TCP only; ...")
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Finding", "Severity"]


class Severity(enum.Enum):
    """How bad a finding is; the command's exit status is the worst one's ``exit_code``."""

    OK = "ok"
    INFO = "info"            # worth knowing, nothing to fix (counts as ok)
    WARNING = "warning"
    ERROR = "error"

    @property
    def exit_code(self) -> int:
        return {"warning": 1, "error": 2}.get(self.value, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One line of the doctor's report: how bad, which check, and what to do."""

    severity: Severity
    check: str
    text: str

    def line(self) -> str:
        return f"{self.severity.value:<8} {self.check:<10} {self.text}"
