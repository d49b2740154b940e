"""Exhaustive search over the states of a :class:`~.model.Model`.

Breadth-first by default: every state is reached first by one of its shortest
paths, and a parent pointer per state gives the shortest trace to any
violation. Depth-first keeps only a set of 64-bit state hashes (for deep runs
that would not fit otherwise) and, on a violation, searches again breadth-first
for the shortest trace to a violation of the same kind.

A violation stops the search (by default); its trace is replayed step by step
with everything the endpoints did, so it reads as a numbered story.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .model import Model, State, Step, Violation
from .scope import Scope


@dataclass(slots=True)
class Found:
    """A broken promise, with the shortest steps that reach it."""

    kind: str
    detail: str
    steps: list[Step]
    story: list[str] = field(default_factory=list)

    def report(self) -> str:
        return "\n".join([f"VIOLATION ({self.kind}): {self.detail}",
                          f"shortest trace, {len(self.steps)} steps:", *self.story])


@dataclass(slots=True)
class Result:
    """What one exploration saw."""

    scope: Scope
    states: int = 0  # distinct states reached
    transitions: int = 0
    finals: int = 0  # states where nothing can happen any more
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = False
    violations: list[Found] = field(default_factory=list)
    snapshots: int = 0
    memo: int = 0

    @property
    def states_per_s(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        verdict = ("OK" if not self.violations else
                   f"{len(self.violations)} VIOLATION(S)")
        return (f"{self.scope.name}: {self.states:,} states, {self.transitions:,} transitions, "
                f"{self.finals:,} final, depth {self.max_depth}, {self.seconds:.1f} s "
                f"({self.states_per_s:,.0f} states/s), "
                f"{'complete' if self.complete else 'INCOMPLETE'} -- {verdict}")


Progress = Callable[[Result], None]


def explore(scope: Scope, *, order: str = "bfs", max_states: int | None = None,
            stop_on_violation: bool = True, progress: Progress | None = None,
            progress_every_s: float = 10.0, model: Model | None = None,
            want: str | None = None, max_seconds: float | None = None) -> Result:
    """Explore every reachable state of ``scope``; stop at the first violation.

    ``want``: only a violation of this kind counts (others prune their state);
    used to find the shortest trace to a kind a depth-first run found.
    """
    model = model or Model(scope)
    res = Result(scope=scope)
    start = last = time.perf_counter()
    root = model.root
    bfs = order == "bfs"
    parents: dict[int, tuple[int, Step] | None] = {}
    seen: set[int] = set()
    h0 = hash(root)
    if bfs:
        parents[h0] = None
    else:
        seen.add(h0)
    frontier: deque[tuple[State, int]] = deque([(root, 0)])
    res.states = 1
    pop = frontier.popleft if bfs else frontier.pop
    links = parents if bfs else None

    def found(v: Violation, h: int, step: Step | None) -> bool:
        """Record ``v``; True if the search must stop."""
        if want is not None and v.kind != want:
            return False
        if not stop_on_violation and any(f.kind == v.kind for f in res.violations):
            return False  # one trace per kind is enough
        _record(model, res, v, links, h, step, bfs)
        return stop_on_violation or want is not None

    stop = False
    while frontier and not stop:
        state, depth = pop()
        h = hash(state)
        steps = model.steps(state)
        if not steps:
            res.finals += 1
            try:
                model.check_final(state)
            except Violation as v:
                stop = found(v, h, None)
            continue
        for step in steps:
            res.transitions += 1
            try:
                nxt = model.apply(state, step)
            except Violation as v:
                if found(v, h, step):
                    stop = True
                    break
                continue
            hn = hash(nxt)
            if bfs:
                if hn in parents:
                    continue
                parents[hn] = (h, step)
            else:
                if hn in seen:
                    continue
                seen.add(hn)
            res.states += 1
            try:
                model.check_state(nxt)  # the touched endpoints are in nxt, the rest agree
            except Violation as v:
                if found(v, hn, None):
                    stop = True
                    break
                continue
            frontier.append((nxt, depth + 1))
            if depth + 1 > res.max_depth:
                res.max_depth = depth + 1
        if max_states is not None and res.states >= max_states:
            break
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        if progress is not None and time.perf_counter() - last >= progress_every_s:
            last = time.perf_counter()
            res.seconds = last - start
            res.snapshots = model.snaps.size
            res.memo = len(model.memo)
            progress(res)
    else:
        res.complete = not stop and not res.violations
    res.seconds = time.perf_counter() - start
    res.snapshots = model.snaps.size
    if res.violations and not bfs:
        shortest = [explore(scope, want=v.kind).violations for v in res.violations]
        res.violations = [s[0] if s else v for s, v in zip(shortest, res.violations,
                                                             strict=True)]
    return res


def _record(model: Model, res: Result, v: Violation,
            parents: dict[int, tuple[int, Step] | None] | None, h: int, step: Step | None,
            bfs: bool) -> None:
    steps: list[Step] = [] if step is None else [step]
    if parents is not None:
        link = parents.get(h)
        while link is not None:
            h, s = link
            steps.append(s)
            link = parents.get(h)
    steps.reverse()
    found = Found(kind=v.kind, detail=v.detail, steps=steps)
    if bfs:
        found.story = replay(model.scope, steps)
    res.violations.append(found)


def replay(scope: Scope, steps: list[Step]) -> list[str]:
    """Run ``steps`` again from the start, narrating every step and every action."""
    model = Model(scope)
    model.log = []
    state = model.root
    lines: list[str] = []
    for n, step in enumerate(steps, 1):
        model.log.clear()
        head = f"{n:3d}. [t={state[1][0]:g}] "
        try:
            state = model.apply(state, step)
            model.check_state(state)
        except Violation as v:
            lines.append(head + (model.log[0] if model.log else model.describe(step)))
            lines += [f"       {x.strip()}" for x in model.log[1:]]
            lines.append(f"     !! {v.kind}: {v.detail}")
            return lines
        lines.append(head + (model.log[0] if model.log else model.describe(step)))
        lines += [f"       {x.strip()}" for x in model.log[1:]]
    try:
        if not model.steps(state):
            model.check_final(state)
    except Violation as v:
        lines.append(f"     !! nothing more can happen, and {v.kind}: {v.detail}")
    return lines


def print_progress(res: Result) -> None:
    print(f"  ... {res.states:,} states, depth {res.max_depth}, {res.seconds:.0f} s "
          f"({res.states_per_s:,.0f} states/s, {res.snapshots:,} endpoint snapshots, "
          f"{res.memo:,} endpoint answers)",
          file=sys.stderr, flush=True)
