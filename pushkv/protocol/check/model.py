"""The system the checker explores: real endpoints inside a modelled world.

:class:`Model` owns one working endpoint per rank and a
:class:`~.snap.Snapshots` store. A *state* is ``(snapshot ids, frozen
world)``; :meth:`Model.steps` lists every step enabled in a state and
:meth:`Model.apply` runs one, calling the real endpoint methods and carrying
out their actions in the world, checking the protocol's promises as it goes.
:meth:`Model.check_state` and :meth:`Model.check_final` check what must hold
in every state and once nothing can happen any more.
"""

from __future__ import annotations

from typing import Any

from ..consumer import Consumer
from ..endpoint import Endpoint
from ..errors import PushKVError
from ..events import (
    Action,
    IssueRead,
    IssueWrite,
    Mode,
    Publish,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    ReleaseStaging,
    Scatter,
    SendMessage,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)
from ..mapping import expected_writers
from ..messages import Cancel, Heartbeat, Message, Register, decode, encode
from ..producer import Producer
from ..states import ConsumerState
from .describe import Describe, brief
from .invariants import _TERMINAL, EpInfo, Invariants, State, Violation, outcome_rule, ready_rule
from .owed import Owed, touched
from .pull import Pull
from .scope import Scope
from .snap import Snapshots
from .staging import Staging
from .world import (
    C_IDLE,
    C_LIVE,
    C_OVER,
    DONE,
    FAILED,
    FRAME,
    HELLO,
    P_HELD,
    P_OVER,
    P_PARTIAL,
    P_PREFILL,
    P_WAIT,
    POSTED,
    READ,
    SCATTER,
    SWRITE,
    TID,
    WRITE,
    Item,
    World,
    done_item,
    frame_item,
    hello_item,
    initial,
)
from .writes import Writes

CS = ConsumerState
Step = tuple[Any, ...]

__all__ = ["Model", "State", "Step", "Violation", "brief", "touched"]


class Model(Invariants, Describe, Staging, Pull, Writes):
    """The real endpoints of one scope, and the rules of the world around them."""

    def __init__(self, scope: Scope, *, check_rejects: bool = True) -> None:
        self.scope = scope
        self.check_rejects = check_rejects
        #: Eager visibility: a write lands whole, then completes (see .world).
        self.eager = scope.visibility == "eager"
        self.distinct = scope.distinct_ids
        pinfo, dinfo = scope.ranks()
        self.np, self.nd = len(pinfo), len(dinfo)
        self.producers = [Producer(i, scope.producer_config()) for i in pinfo]
        self.consumers = [Consumer(i, scope.consumer_config()) for i in dinfo]
        self.pinfo, self.dinfo = pinfo, dinfo
        for p in self.producers:
            for c in self.consumers:
                if not scope.handshake:  # else on demand, when a consumer asks (Connect)
                    p.add_peer(c.info)
                    c.add_peer(p.info)
        # Rule 12: the engine E a router may re-target a held source to (a sink).
        self.e_info = scope.retarget_rank() if scope.retarget else None
        if self.e_info is not None:
            for p in self.producers:
                p.add_peer(self.e_info)
        self.endpoints: list[Endpoint] = [*self.producers, *self.consumers]
        self.renew = self.producers[0].config.renew_fraction
        self.snaps = Snapshots(self.endpoints)
        self.writers = [expected_writers(pinfo[0].engine, dinfo[0].engine, c)
                        for c in range(self.nd)]
        self.d_stride = dinfo[0].layout.stride
        self.owed = Owed(scope, pinfo, dinfo)
        self.p_stride = pinfo[0].layout.stride
        self._messages: dict[bytes, Message] = {}
        self.log: list[str] | None = None  # set to a list to record what happens
        self._info: dict[tuple[int, int], EpInfo] = {}
        self._frames: dict[int, tuple[Message, bytes]] = {}
        #: (endpoint, snapshot, input) -> (next snapshot, actions) or the Violation raised:
        #: an endpoint's answer depends on nothing else, so each is computed once.
        self.memo: dict[tuple[Any, ...], tuple[int, list[Action]] | Violation] = {}
        self.root = self._root()

    def _root(self) -> State:
        ids = tuple(self.snaps.save(i) for i in range(len(self.endpoints)))
        return ids, initial(self.scope)

    # ---------------------------------------------------------------- helpers

    # A *use* ``k`` (0, 1, ...) is incarnation ``k + 1`` of the one id ``t``, or with
    # ``distinct_ids`` incarnation 1 of its own id ``t<k>``. Items in flight name it
    # as ``k + 1`` (their ``inc`` field).

    def _tid(self, k: int) -> str:
        return f"{TID}{k}" if self.distinct else TID

    def _inc(self, k: int) -> dict[str, int]:
        return {"incarnation": 1 if self.distinct else k + 1}

    def _use(self, transfer_id: str, incarnation: int) -> int:
        """The use ``k`` a transfer id and incarnation name (-1: none of ours)."""
        if not self.distinct:
            return incarnation - 1 if transfer_id == TID else -1
        tail = transfer_id[len(TID):]
        return int(tail) if transfer_id.startswith(TID) and tail.isdigit() else -1

    def _k_of(self, action: Any) -> int:
        """Which use (index) an action or message is about."""
        k = self._use(action.transfer_id, int(action.incarnation))
        if not 0 <= k < self.scope.incarnations:
            raise Violation("action", f"{type(action).__name__} names {action.transfer_id}#"
                            f"{action.incarnation}, which is no use of this scope")
        return k

    def _call(self, k: int) -> tuple[str, dict[str, int]]:
        """The transfer id and incarnation keyword of use ``k``, for an endpoint call."""
        return self._tid(k), self._inc(k)

    def info(self, i: int, sid: int) -> EpInfo:
        """What the checker reads of endpoint ``i`` in snapshot ``sid`` (cached)."""
        got = self._info.get((i, sid))
        if got is None:
            self.snaps.load(i, sid)
            ep = self.endpoints[i]
            if isinstance(ep, Consumer):
                states = []
                for k in range(self.scope.incarnations):  # each use's state while it is live
                    tid, inc = self._tid(k), self._inc(k)["incarnation"]
                    live = ep.live_use(tid) == inc
                    states.append(ep.state_of(tid, incarnation=inc) if live else None)
                got = EpInfo(ep.next_deadline(), tuple(states), tuple(sorted(ep.lent_blocks())),
                              (), 0, ep.num_transfers, 0, ep.staging_lent, ep.in_grace,
                              ep.unconsumed())
            else:
                assert isinstance(ep, Producer)
                got = EpInfo(ep.next_deadline(), (), (), tuple(ep.held_blocks().values()),
                             ep.pending_registrations, ep.num_transfers,
                             len(ep.writes_in_flight()), ep.staging_lent)
            self._info[i, sid] = got
        return got

    def _frame(self, msg: Message) -> bytes:
        """The wire frame of a message (each message object is encoded once)."""
        got = self._frames.get(id(msg))
        if got is None or got[0] is not msg:
            got = self._frames[id(msg)] = (msg, encode(msg))
        return got[1]

    def message(self, frame: bytes) -> Message:
        m = self._messages.get(frame)
        if m is None:
            m = self._messages[frame] = decode(frame)
        return m

    def _say(self, text: str) -> None:
        assert self.log is not None
        self.log.append(text)

    # ------------------------------------------------------------------ steps

    def steps(self, state: State) -> list[Step]:
        """Every step enabled in ``state`` (whose endpoints must be loaded)."""
        ids, f = state
        sc = self.scope
        now, flight, dups, drops, dead = f[0], f[1], f[2], f[3], f[4]
        cinc, pinc, d_owner, p_owner = f[7], f[8], f[9], f[10]
        out: list[Step] = []
        seen = None
        for item in flight:
            if item == seen:
                continue
            seen = item
            kind = item[0]
            if kind == FRAME:
                out.append(("deliver", item))
                if item[3] == "E":  # rule 12: the router's re-target is not lost
                    continue
                if dups:
                    out.append(("dup", item))
                if drops:
                    out.append(("drop", item))
            elif kind in (WRITE, SWRITE) and self.eager:
                out.append(("land", item))
                if sc.write_errors:
                    out.append(("wfail", item))
            elif kind in (WRITE, SWRITE):  # weak visibility: bytes and completion apart
                status = item[10]
                if kind == WRITE:
                    out.extend(("piece", item, j) for j in range(len(item[9])))
                elif item[6][3] < len(item[7]):  # the next chunk of a packed write
                    out.append(("land", item))
                if status == POSTED:
                    out.append(("complete", item))
                    if sc.write_errors:
                        out.append(("wfail", item))
                elif status == FAILED:
                    out.append(("vanish", item))
            elif kind == READ:  # pull: the consumer's read of a published source
                out.extend(self.read_steps(item, sc.write_errors))
            elif kind == SCATTER:  # rule 10: the consumer's own copy (within max_write_s)
                out.append(("scatter", item))
                if sc.write_errors:
                    out.append(("sfail", item))
            elif kind == HELLO:
                if dead != "P":  # (a handshake with a dead engine can only fail)
                    out.append(("hello", item))
                out.append(("hsfail", item))
            else:
                out.append(("complete", item))
        obliged = False
        publish: list[Step] = []
        free_d = sum(1 for o in d_owner if o is None)
        free_p = sum(1 for o in p_owner if o is None)
        if dead != "D":
            for k, (status, allocs, _rel, outcomes, aborted, _freed) in enumerate(cinc):
                if status == C_IDLE:
                    if sc.abandons and k and cinc[k - 1][0] == C_LIVE:
                        out.append(("abandon", k))  # ended before it was registered
                    if (self.may_start(k, cinc) and dead != "P" and free_d
                            and (not sc.pull or self.relayed(pinc[k]))):
                        obliged = True  # (with no free block, it waits for a timer)
                        out.append(("register", k))
                    break
                if status != C_LIVE:
                    continue
                states = [self.c_state(c, ids[self.np + c], k) for c in range(self.nd)]
                live = [s for s, o in zip(states, outcomes, strict=True) if o is None]
                if (not aborted and len(allocs) < sc.attempts and states
                        and all(s is CS.REGISTERED for s in states)):
                    out.append(("preempt", k))
                if (live and all(s in (CS.PREEMPTING, CS.PREEMPTED) for s in states)
                        and free_d):  # (the engine reissues whether or not P is alive)
                    obliged = obliged or all(s is CS.PREEMPTED for s in states)
                    out.append(("reissue", k))
                if sc.aborts and not aborted and any(
                        s is not None and s not in _TERMINAL for s in states):
                    out.append(("abort", k))
        if dead != "P":
            for k, (status, _blocks, _rel, aborted, ready, told) in enumerate(pinc):
                if status in (P_PREFILL, P_PARTIAL) and (free_p or status == P_PARTIAL):
                    obliged = True  # (a range takes the blocks first; with none free, the
                    out.append(("prefill", k))  # prefill waits for a timer to free one)
                    out.extend(("range", k, j) for j in range(sc.pieces) if j not in ready)
                # Pull: each rank's core learns of the finished prefill later, on its own
                # (a separate step), and handles the request's abort only after that.
                unpublished = sc.pull and status == P_HELD and len(told) < self.np
                if unpublished:
                    obliged = True
                    publish.extend(("publish", k, r) for r in range(self.np) if r not in told)
                if sc.prefill_aborts and not aborted and not unpublished and status in (
                        P_PREFILL, P_HELD, P_PARTIAL):
                    out.append(("pabort", k))
        if sc.retarget and dead != "P":  # rule 12: once per use, while it is live on D
            out.extend(("retarget", k) for k, ci in enumerate(cinc)
                       if k not in f[19] and (ci[0] == C_LIVE or (
                           sc.linger and ci[0] == C_OVER and all(
                               o is not None and o[0] == "ready" for o in ci[3]))))
        if sc.linger and dead != "D":  # D's first decode step, reported by each rank
            for c in range(self.nd):
                i = self.np + c
                out.extend(("consume", self._use(tid, inc), c)
                           for tid, inc in self.info(i, ids[i]).unconsumed)
        if not dead:
            out.extend(("kill", e) for e in sc.deaths)
        # Timers fire in time order: only the endpoints due first may fire.
        best: float | None = None
        due: list[int] = []
        for i, sid in enumerate(ids):
            if dead and (i < self.np) == (dead == "P"):
                continue
            d = self.info(i, sid).deadline
            if d is None:
                continue
            if best is None or d < best:
                best, due = d, [i]
            elif d == best:
                due.append(i)
        ticks: list[Step] = []
        if best is not None:
            at = max(now, best)
            if not (obliged and at > sc.horizon_s) and all(
                    it[-1] + (sc.max_scatter_s if it[0] == SCATTER else sc.max_write_s) >= at
                    for it in flight if it[0] != FRAME):
                ticks = [("tick", i) for i in due]
        if publish:
            # Pull: a rank's core is told of the finished prefill at any moment (with
            # publish_lag, also after the clock moved; else before it moves). Telling
            # it commutes with every step that is no input of that rank (it sends no
            # frame, and releases nothing a read in flight still takes), so it is
            # offered only where it can race one: while a frame to the rank is in
            # flight, where a timer could fire, or where nothing else (but a death) can.
            quiet = bool(ticks) or all(st[0] == "kill" for st in out)
            out.extend(st for st in publish if quiet or any(
                it[0] == FRAME and it[1] == "P" and it[2] == st[2] for it in flight))
            if not sc.publish_lag:
                ticks = []
        return out + ticks

    def apply(self, state: State, step: Step) -> State:
        """Run ``step`` from ``state`` (endpoints loaded); return the next state.

        Raises :class:`Violation` if a promise broke on the way.
        """
        w = World(state[1])
        ids = list(state[0])
        self._step(w, step, step[0], ids)
        if w.engines_touched:
            self._progress(w)
        return tuple(ids), w.freeze()

    def _step(self, w: World, step: Step, kind: str, ids: list[int]) -> None:
        sc = self.scope
        if kind in ("hello", "hsfail"):
            self._handshake(w, ids, step[1], ok=kind == "hello")
            return
        if kind in ("scatter", "sfail"):
            self._scatter(w, ids, step[1], ok=kind == "scatter")
            return
        if kind in ("read", "readdone", "readfail"):
            self._read(w, ids, step)
            return
        if kind in ("piece", "vanish") or (kind in ("land", "wfail", "complete")
                                          and step[1][0] != DONE and not self.eager):
            self._weak(w, ids, step)
            return
        if kind in ("deliver", "dup", "drop", "land", "wfail", "complete"):
            item = step[1]
            if kind == "dup":
                w.add(item)
                w.dups -= 1
                if self.log is not None:
                    self._say(f"the network duplicates {self._item(item)}")
                return
            w.flight.remove(item)
            if kind == "drop":
                w.drops -= 1
                w.lossy = w.faulted = True
                if self.log is not None:
                    self._say(f"the network drops {self._item(item)}")
            elif kind == "deliver":
                _, dst_e, dst_r, src_e, src_r, frame, _sent = item
                i = dst_r if dst_e == "P" else self.np + dst_r
                msg = self.message(frame)
                if self.log is not None:
                    self._say(f"{dst_e}{dst_r} receives {brief(msg)} from {src_e}{src_r}")
                if dst_e == "P":
                    self._timing(w, dst_r, -1 if src_e == "E" else src_r, msg)
                self._run(w, ids, i, ("m", frame, w.now), lambda ep: ep.receive(msg, w.now))
            elif kind in ("land", "wfail"):
                if kind == "wfail":
                    w.faulted = True
                self._land(w, item, ok=kind == "land")
            else:
                _, p, d, attempt, inc, ok, _sent = item
                if self.log is not None:
                    self._say(f"P{p} learns its write of a{attempt} to {self._peer(d).engine_id}"
                          f"{self._peer(d).rank} "
                              + ("completed" if ok else "failed"))
                tid, kw = self._call(inc - 1)
                self._run(w, ids, p, ("c", attempt, inc, d, ok, w.now),
                          lambda ep: ep.write_completed(tid, attempt, self._peer(d), ok, w.now,
                                                        **kw))
            return
        if kind == "tick":
            i = step[1]
            d = self.info(i, ids[i]).deadline
            assert d is not None
            at = max(w.now, d)
            if at > sc.time_limit_s:
                raise Violation("liveness", f"{self._name(i)} still has a timer due at "
                                f"t={at:g}, past the scope's time limit")
            if at >= sc.window_s:
                w.faulted = True  # a window may have passed: failures are expected now
            if self.log is not None:
                self._say(f"t={at:g}: {self._name(i)}'s timer fires")
            if at > w.now:
                kept = [it for it in w.flight if it[0] != FRAME or it[-1] + sc.max_transit_s >= at]
                if len(kept) != len(w.flight):
                    w.lossy = w.faulted = True
                    if self.log is not None:
                        self._say(f"  (frames older than {sc.max_transit_s:g} s are lost)")
                w.flight = kept
                w.now = at
            self._run(w, ids, i, ("t", w.now), lambda ep: ep.handle_timer(w.now))
            return
        if kind == "kill":
            self._kill(w, step[1], ids)
            return
        if kind == "retarget":
            self._retarget(w, step[1])
            return
        if kind == "consume":  # rule 12: D took its first decode step from use k's KV
            k, c = step[1], step[2]
            if self.log is not None:
                self._say(f"D{c} takes its first decode step of t#{k}")
            self._run(w, ids, self.np + c, ("consume", k, w.now),
                      lambda ep: ep.consumed(self._tid(k), w.now))
            return
        k = step[1]
        if kind in ("register", "reissue"):
            self._allocate(w, k, ids, reissue=kind == "reissue")
        elif kind == "preempt":
            w.faulted = True  # a reissue may find the source gone: failure is allowed
            if self.log is not None:
                self._say(f"D preempts t#{k}")
            for c in range(self.nd):
                self._run(w, ids, self.np + c, ("preempt", k, w.now),
                          lambda ep: ep.preempt(self._tid(k), w.now))
        elif kind == "abandon":
            w.cinc[k].status = C_OVER
            w.faulted = True
            if self.log is not None:
                self._say(f"D ends t#{k} before registering it")
            for c in range(self.nd):
                self._run(w, ids, self.np + c, ("abandon", k, w.now),
                          lambda ep: ep.abandon(self._tid(k), "P", w.now, **self._inc(k)))
        elif kind == "abort":
            w.cinc[k].aborted = True
            w.faulted = True
            if self.log is not None:
                self._say(f"D aborts t#{k}")
            for c in range(self.nd):
                i = self.np + c
                if self.info(i, ids[i]).state[k] not in (None, *_TERMINAL):
                    self._run(w, ids, i, ("abort", k, w.now),
                              lambda ep: ep.abort(self._tid(k), w.now))
        elif kind == "prefill":
            pi = w.pinc[k]
            blocks = pi.blocks if pi.status == P_PARTIAL else self._take(w.p_owner, k)
            pi.status, pi.blocks = P_HELD, blocks
            for r in range(self.np):
                w.leases[r, k] = w.now + sc.lease_s
            if self.log is not None:
                self._say(f"P finishes the prefill of t#{k} into source blocks {list(blocks)}")
            if not sc.pull:  # push: each rank's core is told at once
                for r in range(self.np):
                    self._prefill_finished(w, ids, k, r)
            # Pull: the bytes are final now, and the router may relay the block ids
            # to the consumer engine at once; each rank's core is told later ("publish").
        elif kind == "publish":
            r = step[2]
            w.pinc[k].told = w.pinc[k].told | {r}
            if self.log is not None:
                self._say(f"P{r}'s core learns that the prefill of t#{k} finished")
            self._prefill_finished(w, ids, k, r)
        elif kind == "range":
            self._range(w, k, step[2], ids)
        elif kind == "pabort":
            pi = w.pinc[k]
            pi.aborted = True
            w.faulted = True
            if pi.status == P_PREFILL:
                pi.status = P_OVER
            elif pi.status == P_PARTIAL:  # its blocks wait for the source's release
                pi.status = P_HELD
            if self.log is not None:
                self._say(f"P aborts the request of t#{k}")
            for r in range(self.np):
                self._run(w, ids, r, ("pabort", k, w.now),
                          lambda ep: ep.prefill_aborted(self._tid(k), w.now, **self._inc(k)))
        else:  # pragma: no cover
            raise AssertionError(step)

    def _prefill_finished(self, w: World, ids: list[int], k: int, r: int) -> None:
        """Producer rank ``r``'s core is told that the prefill of use ``k`` finished."""
        blocks, n = w.pinc[k].blocks, self.scope.tokens
        mode = Mode.PULL if self.scope.pull else Mode.PUSH
        self._run(w, ids, r, ("prefill", k, blocks, w.now),
                  lambda ep: ep.prefill_finished(self._tid(k), blocks, n, w.now, mode,
                                                 **self._inc(k)))

    def _range(self, w: World, k: int, j: int, ids: list[int]) -> None:
        """The producer engine reports range ``j`` of incarnation ``k`` final (rule 9)."""
        pi = w.pinc[k]
        if pi.status == P_PREFILL:  # the prefill runs in blocks it takes now
            pi.blocks, pi.status = self._take(w.p_owner, k), P_PARTIAL
            for r in range(self.np):
                w.leases[r, k] = float("inf")  # no lease runs before prefill finished
        pi.ready = pi.ready | {j}
        blocks = pi.blocks
        tokens, layers = self.scope.piece(j)
        if self.log is not None:
            self._say(f"P reports range {j} of t#{k} final: tokens {list(tokens)}, layers "
                      f"{'all' if layers is None else list(layers)}, in blocks {list(blocks)}")
        for r in range(self.np):
            self._run(w, ids, r, ("range", k, j, blocks, w.now),
                      lambda ep: ep.range_ready(self._tid(k), blocks, tokens, w.now,
                                                layers=layers, **self._inc(k)))

    @staticmethod
    def _take(owner: list[Any], tag: Any) -> tuple[int, ...]:
        b = owner.index(None)  # the lowest free block: freed blocks are reused at once
        owner[b] = tag
        return (b,)

    def _allocate(self, w: World, k: int, ids: list[int], *, reissue: bool) -> None:
        ci = w.cinc[k]
        a = len(ci.allocs)
        blocks = self._take(w.d_owner, (k, a))
        for key in [key for key in w.content if key[1] in blocks]:
            del w.content[key]  # fresh blocks hold nothing of ours
        ci.allocs = (*ci.allocs, blocks)
        if reissue:
            if self.log is not None:
                self._say(f"D reissues t#{k} as attempt {a} into blocks {list(blocks)}")
        else:
            ci.status = C_LIVE
            if self.log is not None:
                self._say(f"D registers t#{k} into blocks {list(blocks)}")
        for c in range(self.nd):
            i = self.np + c
            if reissue:
                self._run(w, ids, i, ("reissue", k, blocks, w.now),
                          lambda ep: ep.reissue(self._tid(k), blocks, w.now))
            elif self.scope.pull:
                self._start_pull(w, k, blocks, ids, c)
            else:
                self._run(w, ids, i, ("register", k, blocks, w.now),
                          lambda ep: ep.register(self._tid(k), "P", blocks, self.scope.tokens,
                                                 w.now, **self._inc(k)))

    def _kill(self, w: World, engine: str, ids: list[int]) -> None:
        w.dead = engine
        w.cinc  # noqa: B018 -- the engines' bookkeeping must see the death
        w.lossy = w.faulted = True
        if self.log is not None:
            self._say(f"engine {engine} dies; the transport tells the survivors")
        if engine == "D":  # the transport fails the writes still in flight to it
            w.flight = sorted(done_item(it[1], it[2], it[3], it[4], False, it[-1])
                              if it[0] in (WRITE, SWRITE) else it for it in w.flight
                              if it[0] not in (WRITE, SWRITE) or it[10] == POSTED)
        elif not self.eager:  # a dead producer's writes may still land stray bytes
            w.flight = sorted((*it[:10], FAILED, it[-1]) if it[0] in (WRITE, SWRITE) else it
                              for it in w.flight)
        w.flight = [it for it in w.flight if not self._touches(it, engine, self.eager)]
        survivors = range(self.np, self.np + self.nd) if engine == "P" else range(self.np)
        for i in survivors:
            self._run(w, ids, i, ("died", engine, w.now), lambda ep: ep.peer_died(engine, w.now))

    def _handshake(self, w: World, ids: list[int], item: Item, *, ok: bool) -> None:
        _, d, p, _sent = item
        if not ok:  # this consumer rank gives up on the engine: all its handshakes end
            w.flight = [it for it in w.flight if not (it[0] == HELLO and it[1] == d)]
            w.faulted = w.lossy = True  # no channel to tell the producer: its lease will
            if self.log is not None:
                self._say(f"the handshake of D{d} with P{p} fails")
            self._run(w, ids, self.np + d, ("hsfail", w.now),
                      lambda ep: ep.handshake_failed("P", "refused", w.now))
            return
        w.flight.remove(item)
        w.shaken = w.shaken | {(d, p)}
        if self.log is not None:
            self._say(f"D{d} and P{p} complete their handshake")
        self._run(w, ids, p, ("hello", d, w.now), lambda ep: ep.add_peer(self.dinfo[d]) or [])
        self._run(w, ids, self.np + d, ("hello", p, w.now),
                  lambda ep: ep.add_peer(self.pinfo[p], now=w.now))

    def _connect(self, w: World, d: int) -> None:
        """Consumer rank ``d`` asks for a handshake with every producer rank."""
        if not self.scope.handshake and w.dead != "P":
            raise Violation("handshake", f"D{d} asks to connect to a peer it handshook with")
        busy = {it[2] for it in w.flight if it[0] == HELLO and it[1] == d}
        for p in range(self.np):
            if (d, p) not in w.shaken and p not in busy:
                w.add(hello_item(d, p, w.now))

    # ---------------------------------------------------------------- actions

    def _name(self, i: int) -> str:
        return f"P{i}" if i < self.np else f"D{i - self.np}"

    def _run(self, w: World, ids: list[int], i: int, key: tuple[Any, ...], call: Any) -> None:
        """Give endpoint ``i`` (in snapshot ``ids[i]``) one input, named by ``key``."""
        mkey = (i, ids[i], *key)
        got = self.memo.get(mkey)
        if got is None:
            self.snaps.load(i, ids[i])
            try:
                actions = call(self.endpoints[i])
                got = (self.snaps.save(i), actions)
            except PushKVError as exc:
                got = Violation("refused", f"{self._name(i)} refused a legal call: {exc}")
            except Exception as exc:
                got = Violation("crash", f"{self._name(i)} raised {exc!r}")
            if isinstance(got, Violation):
                self.snaps.invalidate(i)
            self.memo[mkey] = got
        if isinstance(got, Violation):
            raise got
        ids[i] = got[0]
        self._actions(w, i, got[1])

    def _actions(self, w: World, i: int, actions: list[Action]) -> None:
        src = ("P", i) if i < self.np else ("D", i - self.np)
        for a in actions:
            if self.log is not None:
                self._say(f"  -> {self._name(i)}: {self._action(a)}")
            if isinstance(a, SendMessage):
                if i >= self.np:
                    self._lent_by_register(w, i - self.np, a)
                if a.peer.engine_id == "E":
                    continue  # rule 12: E is a sink
                if a.peer.engine_id != w.dead:
                    w.add(frame_item(a.peer, src, self._frame(a.message), w.now))
            elif isinstance(a, IssueWrite):
                self._issue(w, i, a)
            elif isinstance(a, IssueRead):
                self._issue_read(w, i - self.np, a)
            elif isinstance(a, Publish):
                self._publish(w, i, a)
            elif isinstance(a, ReleaseSource):
                self._release_source(w, i, a)
            elif isinstance(a, ReleaseDestination):
                self._release_destination(w, i - self.np, a)
            elif isinstance(a, ReleaseStaging):
                self._release_staging(w, i - self.np, a)
            elif isinstance(a, Scatter):
                self._start_scatter(w, i - self.np, a)
            elif isinstance(a, TransferReady | TransferFailed | TransferCancelled):
                self._outcome(w, i - self.np, a)
            elif isinstance(a, Rejected):
                if self.check_rejects:
                    raise Violation("rejected", f"{self._name(i)} rejected a correct peer's "
                                    f"message: {a.error}")
            elif type(a).__name__ == "Connect":
                self._connect(w, i - self.np)
            else:
                raise Violation("action", f"{self._name(i)} emitted unexpected {a!r}")

    def _release_source(self, w: World, p: int, a: ReleaseSource) -> None:
        blocks = tuple(a.block_ids)
        k = self._k_of(a)
        pi = w.pinc[k] if 0 <= k < len(w.pinc) else None
        if pi is None or pi.blocks != blocks or pi.status != P_HELD:
            raise Violation("source", f"P{p} released source blocks {list(blocks)} it does "
                            "not hold")
        if p in pi.released:
            raise Violation("source", f"P{p} released the source of t#{k} twice")
        pi.released = pi.released | {p}
        w.leases.pop((p, k), None)

    def _timing(self, w: World, p: int, d: int, msg: Message) -> None:
        """Track, generously, when each lease and write window ends (rule 5)."""
        if isinstance(msg, Register):
            k = self._k_of(msg)
            key = (p, d, msg.attempt, k)
            if key not in w.windows:  # the first copy to arrive is the one adopted
                w.windows[key] = w.now + msg.window_ms / 1000.0
        elif isinstance(msg, Cancel):  # that attempt may never be written again
            k = self._k_of(msg)
            w.cancelled = w.cancelled | {(p, d, msg.attempt, k)}
        elif isinstance(msg, Heartbeat):
            sc = self.scope
            for item in msg.transfers:
                k = self._use(item[0], int(item[2]))
                lease = w.leases.get((p, k))
                if lease is not None and w.now < lease:
                    w.leases[p, k] = max(lease, w.now + sc.lease_s * self.renew)

    def _release_destination(self, w: World, d: int, a: ReleaseDestination) -> None:
        blocks = tuple(a.block_ids)
        k = self._k_of(a)
        ci = w.cinc[k]
        if a.attempt >= len(ci.allocs) or ci.allocs[a.attempt] != blocks:
            raise Violation("destination", f"D{d} released blocks {list(blocks)} of t#{k} "
                            f"attempt {a.attempt}, which it was not given")
        if (d, a.attempt) in ci.released:
            raise Violation("destination", f"D{d} released t#{k} attempt {a.attempt} twice")
        ci.released = ci.released | {(d, a.attempt)}

    def _outcome(self, w: World, d: int, a: TransferReady | TransferFailed | TransferCancelled
                 ) -> None:
        k = self._k_of(a)
        ci = w.cinc[k]
        kind = {TransferReady: "ready", TransferFailed: "failed",
                TransferCancelled: "cancelled"}[type(a)]
        cur = len(ci.allocs) - 1
        # The shared rules (the auditor's too): outcome and stale, then bytes.
        rule = outcome_rule(ci.outcomes[d] if ci.status == C_LIVE else "its end", a.attempt,
                            cur)
        if rule == "outcome":
            raise Violation("outcome", f"D{d} reported t#{k} {kind} (attempt {a.attempt}) "
                            f"after {ci.outcomes[d] or 'its end'}")
        if rule == "stale":
            raise Violation("stale", f"D{d} reported t#{k} {kind} for attempt {a.attempt}; "
                            f"the current attempt is {cur}")
        if kind == "ready":
            for b in ci.allocs[cur]:
                for p in sorted(self.writers[d]):
                    for x in sorted(self.owed.whole[d][p]):
                        got = w.content.get((d, b, p, x))
                        if ready_rule(int(got != (k, cur))):
                            had = ("nothing" if got is None else "a failed write" if got[0] < 0
                                   else f"t#{got[0]} attempt {got[1]}")
                            raise Violation("bytes", f"D{d} declared t#{k} attempt {cur} READY "
                                            f"but byte {x} of block {b} holds {had} from P{p}")
        elif not w.faulted:
            reason = getattr(a, "reason", "")
            raise Violation("progress", f"D{d} reports t#{k} {kind} ({reason}) though nothing "
                            "went wrong: no fault, no abort, no deadline")
        outs = list(ci.outcomes)
        outs[d] = (kind, a.attempt)
        ci.outcomes = tuple(outs)

    def _progress(self, w: World) -> None:
        """Engine bookkeeping after a step: ends of incarnations, blocks back to the pools."""
        for ci in w.cinc:
            if ci.status == C_LIVE and (w.dead == "D" or all(o is not None for o in ci.outcomes)):
                ci.status = C_OVER
            if ci.status == C_IDLE or w.dead == "D":
                continue
            for a, blocks in enumerate(ci.allocs):
                if a in ci.freed:
                    continue
                if all((d, a) in ci.released or (ci.status == C_OVER and ci.outcomes[d] ==
                                                 ("ready", a)) for d in range(self.nd)):
                    ci.freed = ci.freed | {a}
                    for b in blocks:
                        w.d_owner[b] = None
        for k, pi in enumerate(w.pinc):
            if pi.status == P_HELD and len(pi.released) == self.np:
                pi.status = P_OVER
                for b in pi.blocks:
                    w.p_owner[b] = None
            if pi.status == P_WAIT and (k == 0 or w.pinc[k - 1].status == P_OVER):
                pi.status = P_PREFILL
