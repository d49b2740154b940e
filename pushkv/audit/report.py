"""A whole run's audit: every use judged, one line per violation, a summary."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from .rules import DEFAULT_GRACE_S, Finding, judge
from .steps import Run, read


@dataclass
class Report:
    """What the audit of one run found."""

    run: Run
    findings: list[Finding]

    @property
    def clean(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        r = self.run
        head = (f"audit: {len(r.uses)} transfer use(s), {r.steps} protocol steps from "
                f"{len(r.processes)} process(es) in {r.files} file(s): ")
        if self.clean:
            return head + "clean"
        by = Counter(f.rule for f in self.findings)
        return head + f"{len(self.findings)} violation(s) (" + ", ".join(
            f"{rule} {n}" for rule, n in sorted(by.items())) + ")"

    def lines(self) -> list[str]:
        return [f.line(self.run.t0) for f in self.findings] + [self.summary()]

    def as_dict(self) -> dict[str, object]:
        r = self.run
        return {"clean": self.clean, "uses": len(r.uses), "steps": r.steps,
                "processes": r.processes, "files": r.files,
                "violations": [f.as_dict(r.t0) for f in self.findings],
                "by_rule": dict(Counter(f.rule for f in self.findings))}


def audit(directory: str | os.PathLike[str], grace_s: float = DEFAULT_GRACE_S) -> Report:
    """Audit the run recorded under ``directory`` (raises
    :class:`~.steps.AuditInputError` when it cannot be read). ``grace_s``: the fence
    grace of consumers whose steps do not carry theirs."""
    run = read(directory)
    found: list[Finding] = []
    for (tid, inc), steps in sorted(run.uses.items()):
        found += judge(tid, inc, steps, grace_s)
    return Report(run, sorted(found, key=lambda f: f.steps[-1].order))
