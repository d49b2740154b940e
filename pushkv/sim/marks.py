"""The simulator's per-request timeline, in :mod:`pushkv.timeline`'s vocabulary and format.

The real connector, proxy and benchmark client record *marks* -- ``(transfer id,
event, time)`` -- at every hop of a request (:data:`pushkv.timeline.EVENTS`); the
simulator records the marks its model has at the simulated moment each happens, so
that ``python -m pushkv.timeline`` and :mod:`pushkv.fit.segments` summarise a
simulated run and a real one alike:

==========================  ==========================================================
``received``, ``legs_sent``  the router: the request arrived and its legs left (push:
                             both at arrival; pull and sequential push: the prefill
                             leg at arrival, as the real proxies mark it)
``prefill_arrived``,         its API server gets to the leg (vLLM's ``arrival_time``):
``decode_arrived``           the leg's turn in the frontends' queue, before ``ingest_s``
``prefill_seen``             the prefill loop first considers the request in a schedule
``decode_seen``              the decode loop first considers it (its leg arrived)
``registration_shipped``     push: decode admits it and orders its registration
``registration_handed``      the order reaches the transport (``order_handoff_s`` later)
``registration_sent``        the ``Register`` message leaves the consumer endpoint
``registration_received``    it reaches the producer endpoint
``prefill_finished``         the prompt's KV is complete
``write_handed``             push: the finished prompt handed to the producer endpoint
``write_posted``             the endpoint's ``IssueWrite`` reaches the writer thread
``write_completed``          the producer learns the write (and notification) completed
``notify_received``          the write's notification reaches the consumer endpoint
``ready``                    the consumer endpoint's ``TransferReady`` (push and pull)
``ready_scheduled``          the decode loop's first schedule that knows the KV landed
``decode_scheduled``         the request admitted for its first decode step
``first_token``              the first token reaches the client (the step's end plus
                             the return path, as the result file's TTFT counts it)
``last_token``               the last token reaches the client
==========================  ==========================================================

Recording is off unless a :class:`Timeline` is handed to the run
(``run(cfg, timeline=...)``, ``pushkv sim --timeline-dir DIR``); it is pure
recording -- no event is scheduled for it, so a run's results do not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .. import timeline as real_timeline

#: Where each simulated mark stands for a real process (the ``p`` field).
PROCESS = {
    "received": "router", "legs_sent": "router", "first_token": "router",
    "last_token": "router",
    "prefill_arrived": "prefill-api-server", "decode_arrived": "decode-api-server",
    "prefill_seen": "prefill-scheduler", "prefill_finished": "prefill-scheduler",
    "decode_seen": "decode-scheduler", "registration_shipped": "decode-scheduler",
    "ready_scheduled": "decode-scheduler", "decode_scheduled": "decode-scheduler",
    "registration_handed": "decode-worker", "ready": "decode-worker",
    "registration_sent": "decode-worker", "notify_received": "decode-worker",
    "registration_received": "prefill-worker", "write_handed": "prefill-worker",
    "write_posted": "prefill-worker", "write_completed": "prefill-worker",
}


class Timeline:
    """Marks of one simulated run: per transfer id, each event's first time (seconds)."""

    def __init__(self) -> None:
        self.requests: dict[str, dict[str, float]] = {}

    def mark(self, transfer_id: str, event: str, t: float) -> None:
        """Record ``event`` of ``transfer_id`` at ``t``; a repeated event keeps its first
        time (as :func:`pushkv.timeline.by_request` does with real marks)."""
        if event not in PROCESS:
            raise ValueError(f"{event!r} is not a simulated timeline mark")
        self.requests.setdefault(transfer_id, {}).setdefault(event, t)

    def lines(self) -> Iterable[str]:
        """The marks as :mod:`pushkv.timeline` JSON lines, request by request, in the
        order of :data:`pushkv.timeline.EVENTS`."""
        order = {e: i for i, e in enumerate(real_timeline.EVENTS)}
        for tid, marks in self.requests.items():
            for ev, t in sorted(marks.items(), key=lambda kv: (kv[1], order[kv[0]])):
                yield json.dumps({"id": tid, "ev": ev, "t": t, "p": f"sim-{PROCESS[ev]}"})

    def write(self, directory: str | Path) -> Path:
        """Write ``DIRECTORY/timeline-sim.jsonl`` (replacing an earlier one)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / "timeline-sim.jsonl"
        out.write_text("".join(line + "\n" for line in self.lines()), encoding="utf-8")
        return out
