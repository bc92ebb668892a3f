"""A check's result and the three-state verdict built from a list of them.

- ``passed``: every check ran and passed;
- ``failed``: at least one check failed;
- ``incomplete``: nothing failed, but something did not run (a skipped check is never a pass).

``validate`` exits 0 / 1 / 3 for these (2 stays a user error). ``--require LEVELS`` turns a required level
that did not run into a failure (check ``required:<level>``), for CI gates that must not pass on less.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvzap_export.errors import ConfigError, ValidationFailedError, ValidationIncompleteError

# The levels a report may hold, in the order they run. ``engine`` is a real serving engine (SGLang).
LEVELS = ("bundle", "operator", "decision", "model", "engine")
VERDICTS = ("passed", "failed", "incomplete")
EXIT_CODES = {"passed": 0, "failed": 1, "incomplete": 3}


@dataclass
class Check:
    name: str
    level: str
    status: str  # passed | failed | skipped
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True only for a check that ran and passed (a skipped check is not a pass)."""
        return self.status == "passed"

    @property
    def ran(self) -> bool:
        return self.status != "skipped"


def skipped(name: str, level: str, reason: str, **detail: Any) -> Check:
    return Check(name, level, "skipped", {"reason": reason, **detail})


def parse_levels(text: str | None) -> tuple[str, ...]:
    """``--require operator,decision,model`` (or ``all``) -> the level names, checked."""
    if not text:
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return tuple(level for level in LEVELS if level != "engine")
    unknown = [n for n in names if n not in LEVELS]
    if unknown or not names:
        raise ConfigError(f"--require {text!r}: unknown level(s) {unknown}; choose from {', '.join(LEVELS)} or 'all'")
    return names


def required_checks(checks: list[Check], required: tuple[str, ...]) -> list[Check]:
    """One failed ``required:<level>`` check for each required level that did not run in full."""
    out = []
    for level in required:
        mine = [c for c in checks if c.level == level]
        missing = [c for c in mine if not c.ran]
        if not mine or missing:
            why = "; ".join(f"{c.name}: {c.detail.get('reason', 'skipped')}" for c in missing) or "no check of this level ran"
            out.append(Check(f"required:{level}", "required", "failed", {"reason": f"level '{level}' is required but did not run: {why}"}))
        else:
            out.append(Check(f"required:{level}", "required", "passed", {"summary": f"level '{level}' ran ({len(mine)} checks)"}))
    return out


def verdict(checks: list[Check]) -> str:
    if any(c.status == "failed" for c in checks):
        return "failed"
    if not checks or any(not c.ran for c in checks):
        return "incomplete"
    return "passed"


def not_run(checks: list[Check]) -> list[dict[str, str]]:
    """What did not run and why, for the report's first lines."""
    return [{"check": c.name, "level": c.level, "reason": c.detail.get("reason", "")} for c in checks if not c.ran]


def verdict_error(report: dict, where: str):
    """The typed error for a report's verdict that is not ``passed`` (None when it is); ``where``: the file
    that says why."""
    if report["verdict"] == "failed":
        return ValidationFailedError(f"validation failed: {', '.join(report['failed'])}; see {where}")
    if report["verdict"] == "incomplete":
        missing = ", ".join(n["check"] for n in report["not_run"])
        return ValidationIncompleteError(f"validation incomplete: nothing failed, but {missing} did not run; see {where} for why")
    return None
