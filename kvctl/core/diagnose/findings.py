"""What doctor and its checks report: findings, each with what it costs and what to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LEVELS = ("error", "warning", "info")


@dataclass
class Finding:
    level: str  # "error", "warning", "info"
    check: str
    what: str
    cost: str
    hint: str | None = None
    instance: str | None = None

    def as_dict(self) -> dict[str, Any]:
        answer = {"level": self.level, "check": self.check, "what": self.what, "cost": self.cost, "hint": self.hint}
        if self.instance is not None:
            answer["instance"] = self.instance
        return answer


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)

    def count(self, level: str) -> int:
        return sum(finding.level == level for finding in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.count("error") else 0

    def as_dict(self) -> dict[str, Any]:
        ordered = sorted(self.findings, key=lambda finding: LEVELS.index(finding.level))
        return {"findings": [finding.as_dict() for finding in ordered], "errors": self.count("error"),
                "warnings": self.count("warning")}


def did_not_run(check: str, why: str, instance: str | None = None) -> Finding:
    return Finding("info", check, why, "this check did not run", None, instance)
