"""What must hold: in every reachable state, and once nothing can happen any more.

:class:`Invariants` is the part of :class:`~.model.Model` that reads a
state and raises :class:`Violation` when a promise of docs/protocol.md is
broken. It reads the endpoints only through :meth:`info` (cached per snapshot).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..states import ConsumerState
from .owed import Owed
from .scope import Scope
from .world import (
    C_IDLE,
    C_LIVE,
    C_OVER,
    P_HELD,
    P_PARTIAL,
    P_PREFILL,
    P_WAIT,
    POSTED,
    SWRITE,
    WRITE,
    Frozen,
)

CS = ConsumerState
#: A state of the whole system: (endpoint snapshot ids, frozen world).
State = tuple[tuple[int, ...], Frozen]
_TERMINAL = frozenset({CS.READY, CS.CANCELLED, CS.FAILED})
#: Consumer states that only an answer of the producer (or a timer) moves on.
_WAITING = frozenset(s for s in CS if s not in _TERMINAL and s.name != "PREEMPTED")


#: The promises the checker holds the endpoints to, by the kind a violation reports.
INVARIANTS = (
    "bytes (READY only when every owed byte holds this use and attempt's data)",
    "reuse (no byte lands in a block not lent to its attempt, however late)",
    "incarnation (nothing of one use touches another, of its id or of another id)",
    "source (no write reads a source released; each released once)",
    "staging (packed bytes land, scatter and free only in their own share)",
    "lease and window (no write starts after either)",
    "cancelled (no write starts after its attempt's Cancel arrived)",
    "unready (no byte written before the engine reported it final)",
    "outcome and stale (one outcome per use and rank, for the current attempt)",
    "progress (no failure without a fault)",
    "prompt (no known answer waited out on a timer; a pull source is released once read)",
    "final (everything ends and is freed)",
    "liveness and bounds (no timer past the time limit; tables bounded)",
    "refused, crash, rejected (no legal call or message refused)",
)


# ------------------------------------------------------------------ the rules themselves
#
# Each promise below is decided by one function of the facts it is about, so that
# every judge of it -- this checker over its world, the auditor (``python -m
# pushkv.audit``) over a real run's timelines -- decides it by the same code. A rule
# returns the kind it breaks (a key of :data:`RULES`) or None.

#: The promises a run's recorded steps can show, by the kind a violation reports.
RULES: dict[str, str] = {
    "source": INVARIANTS[3],
    "lease": "lease (no write starts at or after its source's lease ended)",
    "window": "window (no write starts after its registration's window)",
    "cancelled": "cancelled (no write of an attempt starts after its Cancel arrived or its "
                 "producer answered it with CancelAck or Fail)",
    "reuse": INVARIANTS[1],
    "fence": "fence (blocks go back only once every write posted into them notified, or "
             "the fence grace bounds it; an answer counts every write it posted)",
    "outcome": "outcome (one outcome per use and rank)",
    "stale": "stale (the outcome is the current attempt's)",
    "bytes": "bytes (READY only after every part's notification -- a pull: every read's "
             "completion -- and its digest when checked)",
}


def write_start_rule(now: float, *, held: bool, cancelled: bool, lease_end: float,
                     window_end: float | None = None) -> str | None:
    """A write starting at ``now``: its rank must still hold the source (``held``),
    its attempt not be ``cancelled``, its source's lease not have ended (``now >=
    lease_end`` has) and its registration's window not have passed."""
    if not held:
        return "source"
    if cancelled:
        return "cancelled"
    if now >= lease_end:
        return "lease"
    if window_end is not None and now > window_end:
        return "window"
    return None


def source_release_rule(in_flight: bool) -> str | None:
    """A source released while a write of it may still read it (posted, its completion
    not yet known to the producer)."""
    return "source" if in_flight else None


def landing_rule(lent: bool) -> str | None:
    """A write's bytes (or its notification) land: only in blocks still lent to its
    attempt, however late."""
    return None if lent else "reuse"


def fence_rule(unlanded: int, *, posted: int | None = None, answered: int | None = None
               ) -> str | None:
    """Destination blocks going back with ``unlanded`` writes posted into them that
    neither notified nor can be bounded (the fence grace since they were posted); or a
    producer's answer claiming ``answered`` writes posted where it had posted ``posted``."""
    if unlanded:
        return "fence"
    if posted is not None and answered is not None and posted != answered:
        return "fence"
    return None


def outcome_rule(previous: object, attempt: int, current: int) -> str | None:
    """An outcome (ready, failed, cancelled) reported for ``attempt``: the first for its
    use on its rank (``previous`` is None) and for the current attempt."""
    if previous is not None:
        return "outcome"
    if attempt != current:
        return "stale"
    return None


def ready_rule(missing: int) -> str | None:
    """READY with ``missing`` owed things not there: a part not notified, a notified
    part's digest not checked good, a posted write not landed; for a pull, a posted
    read not completed well, a read's digest not checked good."""
    return "bytes" if missing else None


class EpInfo(NamedTuple):
    deadline: float | None
    state: tuple[Any, ...]  # consumer: state of each use while it is live (else None)
    lent: tuple[int, ...]  # consumer: blocks a write may still land in
    held: tuple[tuple[int, ...], ...]  # producer: source blocks held
    pending: int  # producer: registrations waiting
    transfers: int
    writes: int  # producer: writes it thinks are in flight
    staging: int = 0  # bytes of staging lent (rule 10)
    grace: bool = False  # consumer: a failed write's fence grace is running (rule 7)
    unconsumed: tuple[tuple[str, int], ...] = ()  # consumer: READY, first step not reported


class Violation(Exception):
    """A promise of the protocol was broken (raised inside a step, reported with its trace)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail



class Invariants:
    """The checks; :class:`~.model.Model` provides the endpoints' views."""

    np: int
    nd: int
    scope: Scope
    owed: Owed
    writers: list[frozenset[int]]

    def info(self, i: int, sid: int) -> EpInfo:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _call(self, k: int) -> tuple[str, dict[str, int]]:  # pragma: no cover - by Model
        raise NotImplementedError

    def c_state(self, c: int, sid: int, k: int) -> Any:
        """The state of use ``k`` on consumer rank ``c`` (None: not live there)."""
        return self.info(self.np + c, sid).state[k]

    def may_start(self, k: int, cinc: Any) -> bool:
        """Whether the consumer engine may register use ``k`` now: the first at once; with
        distinct ids each once the one before it started, else once it ended."""
        if k == 0:
            return True
        before = cinc[k - 1][0]
        return bool(before != C_IDLE if self.scope.distinct_ids else before == C_OVER)

    def check_state(self, state: State) -> None:
        """What must hold in every reachable state."""
        ids, f = state
        dead = f[4]
        d_owner, p_owner = f[9], f[10]
        if dead != "D":
            for c in range(self.nd):
                for b in self.info(self.np + c, ids[self.np + c]).lent:
                    if d_owner[b] is None:
                        raise Violation("reuse", f"D{c} still lends block {b}, which its "
                                        "engine already took back")
        if dead != "P":
            for r in range(self.np):
                got = self.info(r, ids[r])
                if got.pending > 64:
                    raise Violation("bounds", f"P{r} holds too many registrations")
                for blocks in got.held:
                    if any(p_owner[b] is None for b in blocks):
                        raise Violation("source", f"P{r} holds source blocks {list(blocks)} "
                                        "its engine already took back")
        for it in f[1]:
            if it[0] in (WRITE, SWRITE) and it[1] in f[8][it[8]][2] and source_release_rule(
                    it[10] == POSTED):
                raise Violation("source", f"P{it[1]} released the source of t#{it[8]} with "
                                "its write still in flight")
        if not f[5] and not f[1]:
            self._check_prompt(ids, f)
            if dead == "" and any(pi[0] == P_PARTIAL and pi[4] for pi in f[8]):
                self._check_ranges(ids, f)

    def _check_ranges(self, ids: tuple[int, ...], f: Frozen) -> None:
        """Rule 9, nothing in flight, nothing lost: a range reported final while a
        consumer rank's registration is held has been written into its blocks."""
        content = dict(f[11])
        for k, pi in enumerate(f[8]):
            ci = f[7][k]
            if pi[0] != P_PARTIAL or ci[0] != C_LIVE:
                continue
            cur = len(ci[1]) - 1
            for c in range(self.nd):
                if (ci[3][c] is not None
                        or self.c_state(c, ids[self.np + c], k) is not CS.REGISTERED):
                    continue
                for b in ci[1][cur]:
                    for p in sorted(self.writers[c]):
                        for j in sorted(pi[4]):
                            if any(content.get((c, b, p, x)) != (k, cur)
                                   for x in self.owed.pieces[c][p][j]):
                                raise Violation("prompt", f"P{p} never wrote range {j} of t#{k}"
                                                f", final while D{c}'s registration of attempt "
                                                f"{cur} is held, with nothing in flight")

    def _check_prompt(self, ids: tuple[int, ...], f: Frozen) -> None:
        """Nothing in flight, nothing lost: every known answer must have been given."""
        cinc, pinc = f[7], f[8]
        owed = False
        for k, ci in enumerate(cinc):
            if ci[0] == C_IDLE or pinc[k][0] in (P_WAIT, P_PREFILL, P_PARTIAL) or (
                    self.scope.pull and pinc[k][0] == P_HELD and len(pinc[k][5]) < self.np):
                # (pull: a rank's core not yet told of the finished prefill is owed a step)
                owed = owed or ci[0] == C_LIVE
                continue  # the producer still owes its prefill
            if ci[0] == C_LIVE:
                for c in range(self.nd):
                    s = self.c_state(c, ids[self.np + c], k)
                    if s in _WAITING and not self.info(self.np + c, ids[self.np + c]).grace:
                        raise Violation("prompt", f"D{c} waits in {s.name} for t#{k} with "
                                        "nothing in flight: only a timer can end the wait")
            elif pinc[k][0] == P_HELD:
                if self._lingers(ids, f, k):
                    continue
                held = sorted(set(range(self.np)) - pinc[k][2])
                raise Violation("prompt", f"P{held[0]} still holds the source of t#{k} after "
                                "every consumer rank learned its outcome, with nothing in "
                                "flight: only its lease will free it")
        if owed:
            return
        for c in range(self.nd):
            got = self.info(self.np + c, ids[self.np + c])
            if (got.lent or got.staging) and not got.grace:
                raise Violation("prompt", f"D{c} still lends blocks {list(got.lent)} and "
                                f"{got.staging} B of staging with nothing in flight: only a "
                                "timer can free them")

    def _lingers(self, ids: tuple[int, ...], f: Frozen, k: int) -> bool:
        """Rule 12: use ``k``'s source may be held, with nothing in flight, for a
        re-target until its hold ends: D died (no Consumed comes), the use went to E
        (a sink: it reports nothing), or a D rank has not reported its first decode
        step yet. Once every D rank reported and the reports arrived, it must go."""
        if not self.scope.linger:
            return False
        if f[4] == "D" or k in f[19]:
            return True
        tid, kw = self._call(k)
        want = (tid, kw["incarnation"])
        return any(want in self.info(self.np + c, ids[self.np + c]).unconsumed
                   for c in range(self.nd))

    def check_final(self, state: State) -> None:
        """Nothing can happen any more: everything must have ended and been freed."""
        ids, f = state
        dead, cinc, pinc = f[4], f[7], f[8]
        if dead != "D":
            for k, ci in enumerate(cinc):
                if ci[0] == C_LIVE:
                    raise Violation("final", f"t#{k} never ended on the consumer: outcomes "
                                    f"{list(ci[3])}")
                if (ci[0] == C_IDLE and self.may_start(k, cinc) and dead != "P"
                        and not (self.scope.pull and not pinc[k][1])):
                    # (pull: a prefill that never finished is never asked for)
                    raise Violation("final", f"t#{k} could never be registered: no free block")
                if len(ci[5]) != len(ci[1]):
                    raise Violation("final", f"blocks of t#{k} never went back to the pool")
            for c in range(self.nd):
                self._final_endpoint(f"D{c}", self.info(self.np + c, ids[self.np + c]))
        if dead != "P":
            for k, pi in enumerate(pinc):
                if pi[0] in (P_PREFILL, P_HELD, P_PARTIAL):
                    raise Violation("final", f"the source of t#{k} was never released "
                                    f"(status {pi[0]}, released by {sorted(pi[2])})")
            for r in range(self.np):
                got = self.info(r, ids[r])
                self._final_endpoint(f"P{r}", got)
                if got.writes:
                    raise Violation("final", f"P{r} still thinks writes are in flight")

    @staticmethod
    def _final_endpoint(name: str, got: EpInfo) -> None:
        if got.lent or got.held:
            raise Violation("final", f"{name} still holds blocks {got.lent or got.held}")
        if got.staging:
            raise Violation("final", f"{name} still lends {got.staging} B of staging")
        if got.transfers:
            raise Violation("final", f"{name} still tracks {got.transfers} transfer(s)")
        if got.deadline is not None:
            raise Violation("final", f"{name} still has a timer at t={got.deadline:g}")
