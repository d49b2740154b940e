"""The auditor: a real run's recorded protocol steps, checked against the protocol.

``python -m pushkv.audit DIR`` reads the timelines every process of a run wrote
into ``DIR`` (the connector's ``timeline_dir``; :data:`pushkv.timeline.STEPS`) and
checks, per use of each transfer and per rank, the promises the model checker
holds the endpoints to -- decided by the checker's own rule functions
(:mod:`pushkv.protocol.check.invariants`):

* no write starts after its source's release, its producer's answer to the attempt
  (CancelAck/Fail), its source's lease end, or its destination's release or READY;
  no source is released with a write of it in flight; no write lands after its
  blocks were released;
* one outcome per use and rank, for the current attempt;
* every release of destination blocks after its fence: each write posted into them
  notified, or the fence grace passed since it was posted; each answer counts the
  writes its rank posted;
* READY only after every part's notification (every chunk), each sealed part's
  digest checked good, and no write posted into the attempt still unlanded.

Exit status: 0 clean, 1 violations, 2 unreadable input.
"""

from __future__ import annotations

from .report import Report, audit
from .rules import DEFAULT_GRACE_S, Finding
from .steps import AuditInputError, Run, Step

__all__ = ["DEFAULT_GRACE_S", "AuditInputError", "Finding", "Report", "Run", "Step", "audit"]
