"""Judging one use of a transfer by its recorded steps.

The steps of a use (transfer id, incarnation) are replayed in the order they
happened (one host's ``CLOCK_MONOTONIC``; each process's own steps in the order it
wrote them). Every promise is decided by the model checker's own rule function
(:mod:`pushkv.protocol.check.invariants`: ``write_start_rule``,
``source_release_rule``, ``landing_rule``, ``fence_rule``, ``outcome_rule``,
``ready_rule``), given the facts the steps show.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..protocol.check.invariants import (
    RULES,
    fence_rule,
    landing_rule,
    outcome_rule,
    ready_rule,
    source_release_rule,
    write_start_rule,
)
from .steps import Step

#: The bound a consumer may fence unlanded writes by, when its steps do not say
#: (``ConsumerConfig.fence_grace_s``' default).
DEFAULT_GRACE_S = 30.0

Leg = tuple[str, str, int]  # (producer rank, consumer rank, attempt)


@dataclass(frozen=True)
class Finding:
    """A broken promise: its rule, where, why, and the steps that show it."""

    rule: str
    transfer_id: str
    incarnation: int
    attempt: int
    rank: str
    detail: str
    steps: tuple[Step, ...]

    @property
    def text(self) -> str:
        return RULES[self.rule]

    def line(self, t0: float) -> str:
        events = ", ".join(s.describe(t0) for s in self.steps)
        return (f"VIOLATION {self.rule}: transfer {self.transfer_id} incarnation "
                f"{self.incarnation} attempt {self.attempt} rank {self.rank}: {self.detail} "
                f"[{events}] -- {self.text}")

    def as_dict(self, t0: float) -> dict[str, object]:
        return {"rule": self.rule, "text": self.text, "transfer_id": self.transfer_id,
                "incarnation": self.incarnation, "attempt": self.attempt, "rank": self.rank,
                "detail": self.detail,
                "events": [{"event": s.event, "t": s.t, "t_rel_s": round(s.t - t0, 6),
                            "process": s.process} for s in self.steps]}


@dataclass
class _Write:
    post: Step
    chunks: int
    landed: set[int] = field(default_factory=set)
    done: Step | None = None

    @property
    def whole(self) -> bool:
        return len(self.landed) >= self.chunks


class _Use:
    """The state of one use while its steps are replayed."""

    def __init__(self, tid: str, inc: int, grace_s: float) -> None:
        self.tid, self.inc, self.grace_s = tid, inc, grace_s
        self.found: list[Finding] = []
        self.writes: dict[Leg, list[_Write]] = defaultdict(list)
        self.notes: dict[Leg, list[Step]] = defaultdict(list)
        self.digests: dict[Leg, list[Step]] = defaultdict(list)
        self.released: dict[str, Step] = {}  # producer rank -> its source release
        self.lease_end: dict[str, Step] = {}  # producer rank -> its Fail(LEASE_EXPIRED)
        self.answered: dict[Leg, Step] = {}
        self.freed: dict[tuple[str, int], Step] = {}
        self.ready: dict[tuple[str, int], Step] = {}
        self.outcome: dict[str, Step] = {}
        self.registered: dict[str, int] = {}
        self.pull: set[tuple[str, int]] = set()
        self.reads: dict[Leg, list[Step]] = defaultdict(list)  # pull: posted, by leg
        self.reads_done: dict[Leg, list[Step]] = defaultdict(list)  # and completed

    def flag(self, rule: str | None, s: Step, rank: str, detail: str, *steps: Step | None
             ) -> None:
        if rule is not None:
            shown = tuple(sorted({x.order: x for x in (*steps, s) if x is not None}.values(),
                                 key=lambda x: x.order))
            self.found.append(Finding(rule, self.tid, self.inc, int(s.get("att", -1)), rank,
                                      detail, shown))

    @staticmethod
    def leg(s: Step) -> Leg:
        return s.get("src"), s.get("dst"), int(s.get("att", -1))

    # --------------------------------------------------------------- producer

    def write_posted(self, s: Step) -> None:
        src, dst, att = self.leg(s)
        lease = self.lease_end.get(src)
        answered = self.answered.get((src, dst, att))
        rule = write_start_rule(s.t, held=src not in self.released,
                                cancelled=answered is not None,
                                lease_end=lease.t if lease is not None else float("inf"))
        why = {"source": "a write posted from a source its rank had released",
               "cancelled": "a write posted after its producer answered the attempt "
                            "(CancelAck/Fail: no more writes of it)",
               "lease": "a write posted after its source's lease ended"}.get(rule or "", "")
        self.flag(rule, s, src, why, self.released.get(src) if rule == "source" else
                  answered if rule == "cancelled" else lease)
        gone = self.freed.get((dst, att)) or self.ready.get((dst, att))
        self.flag(landing_rule(gone is None), s, dst, "a write posted into blocks its "
                  "consumer rank had already " + ("released" if gone is not None and
                                                  gone.event == "dest_released" else
                                                  "declared READY"), gone)
        self.writes[src, dst, att].append(_Write(s, max(1, int(s.get("chunks", 1)))))

    def write_completed(self, s: Step) -> None:
        for w in self.writes.get(self.leg(s), ()):
            if w.done is None:
                w.done = s
                return

    def answer_sent(self, s: Step) -> None:
        leg = self.leg(s)
        self.answered.setdefault(leg, s)
        if s.get("reason") == "LEASE_EXPIRED":
            self.lease_end.setdefault(leg[0], s)
        posted = len(self.writes.get(leg, ()))
        self.flag(fence_rule(0, posted=posted, answered=int(s["posted"])), s, leg[0],
                  f"the answer counts {s['posted']} write(s) posted to {leg[1]}; its rank "
                  f"posted {posted}", *(w.post for w in self.writes.get(leg, ())))

    def source_released(self, s: Step) -> None:
        src = s.get("src")
        for (p, _, _), writes in self.writes.items():
            for w in writes:
                if p == src and w.done is None:
                    self.flag(source_release_rule(True), s, src, "the source released with "
                              "a write of it still in flight (its completion not yet known)",
                              w.post)
        self.released.setdefault(src, s)

    # --------------------------------------------------------------- consumer

    def registration_sent(self, s: Step) -> None:
        dst = s.get("dst")
        self.registered[dst] = max(self.registered.get(dst, 0), int(s["att"]))

    def read_posted(self, s: Step) -> None:
        self.pull.add((s.get("dst"), int(s["att"])))
        self.reads[self.leg(s)].append(s)

    def read_completed(self, s: Step) -> None:
        self.reads_done[self.leg(s)].append(s)

    def notify_received(self, s: Step) -> None:
        leg = self.leg(s)
        self.notes[leg].append(s)
        for w in self.writes.get(leg, ()):
            if int(w.post["part"]) == int(s["part"]) and not w.whole:
                w.landed.add(int(s.get("chunk", 0)))
                break
        gone = self.freed.get((leg[1], leg[2]))
        self.flag(landing_rule(gone is None), s, leg[1], "a write landed (notified) after its "
                  "blocks were released", gone)

    def digest_checked(self, s: Step) -> None:
        self.digests[self.leg(s)].append(s)

    def dest_released(self, s: Step) -> None:
        dst, att = s.get("dst"), int(s["att"])
        grace = s.get("grace")
        grace = self.grace_s if grace is None else float(grace)
        unlanded = [w.post for (_, d, a), writes in self.writes.items() if (d, a) == (dst, att)
                    for w in writes if not w.whole and s.t < w.post.t + grace]
        self.flag(fence_rule(len(unlanded)), s, dst, f"blocks released with {len(unlanded)} "
                  f"write(s) posted into them neither notified nor {grace:g} s (the fence "
                  "grace) old", *unlanded)
        self.freed.setdefault((dst, att), s)

    def outcome_step(self, s: Step) -> None:
        dst, att = s.get("dst"), int(s["att"])
        prev = self.outcome.get(dst)
        current = max(self.registered.get(dst, att), att)
        rule = outcome_rule(prev.get("kind") if prev is not None else None, att, current)
        self.flag(rule, s, dst, (f"a second outcome ({s['kind']}) after {prev['kind']}"
                                 if prev is not None else
                                 f"{s['kind']} for attempt {att}; attempt {current} was "
                                 "registered since"), prev)
        self.outcome.setdefault(dst, s)
        if s["kind"] == "ready":
            self._ready(s, dst, att)

    def _ready(self, s: Step, dst: str, att: int) -> None:
        self.ready.setdefault((dst, att), s)
        if (dst, att) in self.pull:
            self._pull_ready(s, dst, att)
            return
        legs = {leg for leg in (*self.writes, *self.notes) if leg[1:] == (dst, att)}
        missing: list[str] = []
        shown: list[Step] = []
        if not legs:
            missing.append("no write notified at all")
        for leg in sorted(legs, key=str):
            src, notes = leg[0], self.notes.get(leg, [])
            parts = max((int(n["parts"]) for n in notes if int(n["parts"]) > 0), default=0)
            if not parts:
                missing.append(f"the last part from {src}")
            for part in range(parts):
                got = [n for n in notes if int(n["part"]) == part]
                chunks = max((int(n.get("chunks", 1)) for n in got), default=1)
                if len({int(n.get("chunk", 0)) for n in got}) < chunks:
                    missing.append(f"part {part} from {src}" + (f" ({chunks} chunks)"
                                                                if chunks > 1 else ""))
            sealed = {int(n["part"]) for n in notes if n.get("sealed")}
            self._digests(leg, len(sealed), "part", missing, shown)
            for w in self.writes.get(leg, ()):
                if not w.whole:
                    missing.append(f"the landing of part {w.post['part']} from {src}")
                    shown.append(w.post)
        self.flag(ready_rule(len(missing)), s, dst, "READY before " + "; ".join(missing),
                  *shown)

    def _pull_ready(self, s: Step, dst: str, att: int) -> None:
        """Pull: READY only after every read the rank posted for the attempt completed
        well, and each checked one's digest was good (the same rule as a push's)."""
        legs = {leg for leg in self.reads if leg[1:] == (dst, att)}
        missing: list[str] = []
        shown: list[Step] = []
        if not legs:
            missing.append("no read posted at all")
        for leg in sorted(legs, key=str):
            src, posted, done = leg[0], self.reads[leg], self.reads_done.get(leg, [])
            ok = [d for d in done if d["ok"]]
            if len(ok) < len(posted):
                missing.append(f"{len(posted) - len(ok)} read(s) from {src} completing well")
                shown += posted[len(ok):] + [d for d in done if not d["ok"]]
            self._digests(leg, sum(1 for d in ok if d.get("sealed")), "read", missing, shown)
        self.flag(ready_rule(len(missing)), s, dst, "READY before " + "; ".join(missing),
                  *shown)

    def _digests(self, leg: Leg, sealed: int, what: str, missing: list[str],
                 shown: list[Step]) -> None:
        """What a leg's digests leave missing: a failed one, or fewer good ones than
        its ``sealed`` parts (or reads) to check."""
        digests = self.digests.get(leg, [])
        bad = [d for d in digests if not d["ok"]]
        good = len(digests) - len(bad)
        if bad:
            missing.append(f"a good digest from {leg[0]} ({len(bad)} failed)")
            shown += bad
        elif good < sealed:
            missing.append(f"the digest of {sealed - good} sealed {what}(s) from {leg[0]}")


_HANDLERS = {
    "write_posted": _Use.write_posted,
    "write_completed": _Use.write_completed,
    "answer_sent": _Use.answer_sent,
    "source_released": _Use.source_released,
    "registration_sent": _Use.registration_sent,
    "read_posted": _Use.read_posted,
    "read_completed": _Use.read_completed,
    "notify_received": _Use.notify_received,
    "digest_checked": _Use.digest_checked,
    "dest_released": _Use.dest_released,
    "outcome": _Use.outcome_step,
}


def judge(tid: str, inc: int, steps: list[Step], grace_s: float = DEFAULT_GRACE_S
          ) -> list[Finding]:
    """The promises the steps of one use (in their order) show broken."""
    use = _Use(tid, inc, grace_s)
    for s in steps:
        _HANDLERS[s.event](use, s)
    return use.found
