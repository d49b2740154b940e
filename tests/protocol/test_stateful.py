"""Random interleavings of everything, with the invariants checked after every step.

A Hypothesis rule-based machine drives one producer engine and one consumer
engine (several TP ratios and block sizes) through the in-memory transport in
*hold* mode: nothing moves until a rule delivers, duplicates or drops a chosen
item, so registrations, prefill completions, writes, notifications, cancels
and acknowledgements arrive in any order. Engine-level block pools hand freed
blocks to new transfers at once, so a write into reused memory is caught.
Transfer ids come back (a new incarnation of an ended transfer, while the old
one's messages may still be in flight), and some topologies have producer
ranks that write nothing (replicated heads): when nothing was lost, every
rank must have released a finished transfer's source without waiting for its
lease. A second machine runs the same rules with staging memory on every rank and
every whole-request write packed (rule 10): the consumer's scatters are items
in flight too, delivered late, reordered or failed like writes (a third pipelines
every packed write in chunks, each notified and scattered on its own), and no staging
may stay lent at the end.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pushkv.protocol import (
    ConsumerConfig,
    ConsumerState,
    Mode,
    PackingConfig,
    ProducerConfig,
    new_incarnation,
    uniform_ranks,
)
from pushkv.transports.conformance import reference_destination
from pushkv.transports.inmemory import pair

TOPOLOGIES = [
    ({"num_kv_heads": 2}, {"num_kv_heads": 2}),
    ({"tp": 2, "num_kv_heads": 2}, {"num_kv_heads": 2}),
    ({"num_kv_heads": 2}, {"tp": 2, "num_kv_heads": 2}),
    ({"tp": 2, "num_kv_heads": 2}, {"tp": 2, "num_kv_heads": 2, "block_size": 8}),
    ({"num_kv_heads": 2, "block_size": 8}, {"num_kv_heads": 2, "order": "HND"}),
    ({"num_kv_heads": 2, "order": "BLOCK"}, {"num_kv_heads": 2, "order": "BLOCK"}),
    ({"tp": 2, "num_kv_heads": 1}, {"num_kv_heads": 1}),  # producer rank 1 writes nothing
    ({"tp": 2, "num_kv_heads": 1, "mla": True}, {"tp": 2, "num_kv_heads": 1, "mla": True}),
]
_ENDED = (None, ConsumerState.READY, ConsumerState.CANCELLED, ConsumerState.FAILED)
WINDOW, GRACE, LEASE = 4.0, 2.0, 6.0
MAX_TRANSIT = 0.5


def _plain(fn):
    """Keep the undecorated function reachable (to create transfers at set-up)."""
    fn.__wrapped__ = fn
    return fn


class Transfer:
    def __init__(self, tid: str, inc: int, n: int, pull: bool, first: int = 0):
        self.tid, self.inc, self.n, self.pull = tid, inc, n, pull
        self.key = (tid, inc)
        self.first = min(first, n)  # tokens decode already holds (a cached prefix)
        self.src: list[int] | None = None
        self.dst: dict[int, list[int]] = {}  # attempt -> blocks
        self.attempt = -1
        self.freed: set[int] = set()  # attempts whose blocks went back to the pool
        self.done = False  # the engine is finished with the request
        self.streamed = False  # some ranges were reported before prefill finished
        self.prefilled = False
        self.aborted = False  # the producer engine aborted the request
        self.published = 0.0  # pull: when prefill published the source (its lease began)


class Protocol(RuleBasedStateMachine):
    transfers = Bundle("transfers")
    #: Staging memory of every rank (None: every write is direct).
    PACKING: PackingConfig | None = None

    @initialize(target=transfers, topo=st.sampled_from(TOPOLOGIES), seed=st.integers(0, 2**16),
                sizes=st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1,
                               max_size=3))
    def setup(self, topo, seed, sizes):
        pkw, ckw = topo
        base = {"num_blocks": 24, "block_size": 4, "head_dim": 4, "dtype_bytes": 2}
        self.pinfo = uniform_ranks("P", **(base | pkw))
        self.cinfo = uniform_ranks("D", **(base | ckw))
        # The transport's adversarial delivery: bytes land in pieces, apart from the
        # completions; a READ takes its source's bytes until it completes.
        self.net = pair(
            self.pinfo, self.cinfo, seed=seed, hold=True, detect_s=0.5,
            max_transit_s=MAX_TRANSIT, max_write_s=0.5, packing=self.PACKING,
            producer_config=ProducerConfig(lease_s=LEASE, max_pending_registrations=64),
            consumer_config=ConsumerConfig(window_s=WINDOW, fence_grace_s=GRACE,
                                           heartbeat_s=1.0),
        )
        self.p_free = list(range(self.pinfo[0].layout.num_blocks))
        self.c_free = list(range(self.cinfo[0].layout.num_blocks))
        self.model: dict[tuple[str, int], Transfer] = {}
        self.current: dict[str, Transfer] = {}  # the latest incarnation of each id
        self.rng = random.Random(seed)
        self.lossy = False  # something was dropped or expired: leases may be needed
        self.ready_at: dict[tuple[str, int], float] = {}  # READY on every consumer rank
        self.checked_ready: set[tuple[int, str, int]] = set()
        self.count = 0
        self.dead = set()
        return multiple(*(self.new_transfer.__wrapped__(self, n, pull) for n, pull in sizes))

    # ------------------------------------------------------------ helpers

    @property
    def producers(self):
        return [n for n in self.net.producers.values() if n.alive]

    @property
    def consumers(self):
        return [n for n in self.net.consumers.values() if n.alive]

    def _take(self, pool, k):
        if len(pool) < k:
            return None
        got, pool[:] = pool[:k], pool[k:]
        return got

    def _states(self, t):
        return {c.endpoint.state_of(t.tid, incarnation=t.inc) for c in self.consumers}

    # -------------------------------------------------------------- rules

    @rule(target=transfers, n=st.integers(1, 40), pull=st.booleans(),
          first=st.sampled_from([0, 0, 0, 4, 5, 9]))
    @_plain
    def new_transfer(self, n, pull, first=0):
        self.count += 1
        if self.cinfo[0].layout.order == "BLOCK":  # opaque blocks: whole-block prefixes
            first = min(first, n)  # (a prefix cut to the request must stay whole blocks)
            first -= first % self.cinfo[0].layout.block_size
        return self._add(f"t{self.count}", n, pull, first)

    def _add(self, tid, n, pull, first):
        t = Transfer(tid, new_incarnation(self.rng), n, pull, first)
        self.model[t.key] = self.current[tid] = t
        note(f"new {'pull' if pull else 'push'} {t.key} n={n} first={t.first}")
        return t

    @rule(target=transfers, i=st.integers(0, 10**6))
    def reuse_id(self, i):
        """The id of an ended request comes back at once, as a new incarnation."""
        ended = [t for t in self.current.values()
                 if t.attempt >= 0 and not self._states(t) - set(_ENDED)]
        if not ended:
            return multiple()
        t = ended[i % len(ended)]
        new = self._add(t.tid, t.n, t.pull, t.first)
        self.register(new)  # at once, while the old use's messages may be in flight
        return new

    def _cur(self, t):
        return self.current[t.tid] is t

    @rule(t=transfers)
    def start_pull(self, t):
        """Pull: the router relays the published block ids; decode reads them."""
        if not t.pull or t.src is None or t.attempt >= 0 or self.dead or not self._cur(t):
            return
        pub = [p.published.get(t.tid) for p in self.producers]
        if not all(a is not None and a.incarnation == t.inc for a in pub):
            return  # nothing was published (the request ended first): nothing to relay
        k = -(-t.n // self.cinfo[0].layout.block_size)
        blocks = self._take(self.c_free, k)
        if blocks is None:
            return
        t.attempt, t.dst[0] = 0, blocks
        note(f"pull {t.tid} -> {blocks}")
        for c in self.consumers:
            # The router relays the publication's lease, less its own delay bound.
            lease = t.published + LEASE - MAX_TRANSIT - self.net.now
            c.apply(c.endpoint.start_pull(t.tid, "P", t.src, blocks, t.n, self.net.now,
                                          first_token=t.first, incarnation=t.inc,
                                          lease_s=lease))

    @rule(t=transfers)
    def register(self, t):
        if t.pull or t.attempt >= 0 or self.dead or not self._cur(t):
            return  # after a death, nobody registers with a peer it knows is gone
        k = -(-t.n // self.cinfo[0].layout.block_size)
        blocks = self._take(self.c_free, k)
        if blocks is None:
            return
        t.attempt, t.dst[0] = 0, blocks
        note(f"register {t.tid} -> {blocks}")
        for c in self.consumers:
            c.apply(c.endpoint.register(t.tid, "P", blocks, t.n, self.net.now,
                                        first_token=t.first, incarnation=t.inc))

    @rule(t=transfers, a=st.integers(0, 39), w=st.integers(1, 40), layer=st.integers(0, 1),
          all_layers=st.booleans())
    def range_ready(self, t, a, w, layer, all_layers):
        """Progressive push: part of the prefill is final (any range, any order)."""
        if t.pull or t.prefilled or t.aborted or "P" in self.dead:
            return
        if t.src is None:
            k = -(-t.n // self.pinfo[0].layout.block_size)
            blocks = self._take(self.p_free, k)
            if blocks is None:
                return
            t.src, t.streamed = blocks, True
        a %= t.n
        b = min(t.n, a + w)
        layers = None if all_layers else (layer, layer + 1)
        note(f"range {t.tid} tokens [{a}, {b}) layers {layers}")
        for p in self.producers:
            p.apply(p.endpoint.range_ready(t.tid, t.src, (a, b), self.net.now, layers=layers,
                                           incarnation=t.inc))

    @rule(t=transfers)
    def prefill(self, t):
        if t.prefilled or (t.streamed and t.aborted) or "P" in self.dead:
            return
        k = -(-t.n // self.pinfo[0].layout.block_size)
        blocks = t.src if t.streamed else self._take(self.p_free, k)
        if blocks is None:
            return
        if t.pull and t.attempt >= 0:
            return  # a pull transfer starts from what prefill published
        t.src, t.prefilled, t.published = blocks, True, self.net.now
        note(f"prefill {t.tid} <- {blocks}")
        mode = Mode.PULL if t.pull else Mode.PUSH
        for p in self.producers:
            p.apply(p.endpoint.prefill_finished(t.tid, blocks, t.n, self.net.now, mode=mode,
                                                incarnation=t.inc))

    @rule(t=transfers)
    def preempt(self, t):
        if t.attempt >= 0 and self._cur(t) and self._states(t) == {ConsumerState.REGISTERED}:
            note(f"preempt {t.tid}")
            for c in self.consumers:
                c.apply(c.endpoint.preempt(t.tid, self.net.now))

    @rule(t=transfers)
    def reissue(self, t):
        states = self._states(t)
        if not self._cur(t) or not states or not states <= {ConsumerState.PREEMPTING,
                                                            ConsumerState.PREEMPTED}:
            return
        if any(not c.endpoint.knows("P") for c in self.consumers):
            return
        k = -(-t.n // self.cinfo[0].layout.block_size)
        blocks = self._take(self.c_free, k)
        if blocks is None:
            return
        t.attempt += 1
        t.dst[t.attempt] = blocks
        note(f"reissue {t.tid}#{t.attempt} -> {blocks}")
        for c in self.consumers:
            c.apply(c.endpoint.reissue(t.tid, blocks, self.net.now))

    @rule(t=transfers)
    def abort(self, t):
        live = [c for c in self.consumers if self._cur(t) and c.endpoint.state_of(
            t.tid, incarnation=t.inc) not in _ENDED]
        if live:
            note(f"abort {t.tid}")
        for c in live:
            c.apply(c.endpoint.abort(t.tid, self.net.now))

    @rule(t=transfers)
    def producer_abort(self, t):
        note(f"producer abort {t.tid}")
        t.aborted = True
        for p in self.producers:
            p.apply(p.endpoint.prefill_aborted(t.tid, self.net.now, incarnation=t.inc))

    @precondition(lambda self: self.net.pending)
    @rule(i=st.integers(0, 10**6))
    def deliver(self, i):
        item = self.net.deliver(i % len(self.net.pending))
        note(f"deliver {item.kind} {item.src} -> {item.dst}")

    @precondition(lambda self: self.net.pending)
    @rule(i=st.integers(0, 10**6))
    def duplicate(self, i):
        self.net.duplicate(i % len(self.net.pending))

    @precondition(lambda self: self.net.pending)
    @rule(i=st.integers(0, 10**6))
    def drop(self, i):
        item = self.net.drop(i % len(self.net.pending))
        if item is not None:
            self.lossy = True
            note(f"drop {item.kind} {item.src} -> {item.dst}")

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    def tick(self, dt):
        self.net.tick(dt)

    @rule()
    def flow(self):
        """Everything in flight moves, in time order, for a moment (progress)."""
        self.net.run(until=self.net.now + 0.02)

    @precondition(lambda self: not self.dead)
    @rule(engine=st.sampled_from(["P", "D"]))
    def kill(self, engine):
        note(f"kill {engine}")
        self.dead.add(engine)
        self.net.kill(engine)

    @rule()
    def engine_housekeeping(self):
        self._free_blocks()

    # -------------------------------------------------- engine block pools

    def _free_blocks(self):
        """Return blocks to the engine pools the way vLLM would: once every rank
        released them (destination) or the request is over (ready/failed)."""
        cons = list(self.net.consumers.values())
        for t in self.model.values():
            for attempt, blocks in t.dst.items():
                if attempt in t.freed:
                    continue
                released = all(any((r.transfer_id, r.incarnation) == t.key
                                   and r.attempt == attempt for r in c.released) for c in cons)
                ready = attempt == t.attempt and all(
                    ("ready", attempt) in c.outcomes_by_key.get(t.key, []) or any(
                        (r.transfer_id, r.incarnation) == t.key and r.attempt == attempt
                        for r in c.released)
                    for c in cons)
                if "D" in self.dead:
                    released = True  # a dead engine's memory is gone with it
                if released or ready:
                    t.freed.add(attempt)
                    if "D" not in self.dead:
                        self.c_free += blocks
        for t in self.model.values():
            if (t.src is not None and not t.done and "P" not in self.dead
                    and all(p.released_by_key[t.key] >= 1 for p in self.net.producers.values())):
                t.done = True
                self.p_free += t.src

    # ---------------------------------------------------------- invariants

    @invariant()
    def no_violation(self):
        assert not self.net.violations, self.net.violations

    @invariant()
    def free_blocks_are_never_lent(self):
        free = set(self.c_free)
        for c in self.consumers:
            lent = set(c.endpoint.lent_blocks())
            assert not (free & lent), f"blocks {free & lent} are free but may be written"
        held = {b for p in self.producers for ids in p.endpoint.held_blocks().values() for b in ids}
        assert not (set(self.p_free) & held)

    @invariant()
    def ready_means_every_byte_landed(self):
        psrc = [p.memory for p in self.net.producers.values()]
        for c in self.net.consumers.values():
            for tkey, seen in c.outcomes_by_key.items():
                kinds = [k for k, _ in seen]
                assert len(kinds) == len(set(seen)), f"{tkey} reported twice: {seen}"
                for kind, attempt in seen:
                    key = (c.peer.rank, tkey, attempt)
                    if kind != "ready" or key in self.checked_ready:
                        continue
                    self.checked_ready.add(key)
                    t = self.model[tkey]
                    assert attempt == t.attempt, "a stale attempt became ready"
                    want = reference_destination(self.pinfo, psrc, c.info,
                                                 [(t.src, t.dst[attempt], t.n, t.first)],
                                                 base=c.memory)
                    for region, (w, g) in enumerate(zip(want, c.memory, strict=True)):
                        assert np.array_equal(w, g), f"{tkey} region {region} differs"

    @invariant()
    def note_when_ready(self):
        for t in self.model.values():
            if t.key not in self.ready_at and t.attempt >= 0 and all(
                    c.outcomes_by_key.get(t.key, [None])[-1] == ("ready", t.attempt)
                    for c in self.consumers):
                self.ready_at[t.key] = self.net.now

    @invariant()
    def tables_are_bounded(self):
        for p in self.producers:
            assert p.endpoint.pending_registrations <= 64
            assert len(p.endpoint._tombstones) <= p.endpoint.config.max_tombstones

    def teardown(self):
        """Deliver everything, let every deadline pass: all must end, nothing leak."""
        if not hasattr(self, "net"):
            return
        horizon = WINDOW + GRACE + LEASE + 70.0
        # Property 2: with nothing lost, every rank releases a finished transfer's
        # source as soon as its outcome is known -- ranks that write nothing too --
        # not at lease expiry: within the transit bound (0.5) of READY.
        self.net.run(until=self.net.now + 1.0)
        self._free_blocks()
        if not self.lossy and not self.dead and not self.net.stats["frames_expired"]:
            for key, at in self.ready_at.items():
                if self.model[key].src is None or self.model[key].streamed:
                    continue  # a streamed source waits for its prefill to finish
                for p in self.producers:
                    when = p.released_at.get(key)
                    assert when is not None and when <= at + 0.5 + 1e-9, (
                        f"{p.peer} released {key} at {when}, READY at {at}")
        self.net.run(until=self.net.now + horizon)
        self._free_blocks()
        for c in self.consumers:
            # Progress: everything ended except preempted requests, which wait for
            # their engine to reissue or abort them -- as it eventually does.
            assert c.endpoint.lent_blocks() == {}, c.endpoint.lent_blocks()
            assert all(c.endpoint.state_of(t.tid, incarnation=t.inc) in (
                None, ConsumerState.PREEMPTED) for t in self.current.values())
            for t in self.current.values():
                if c.endpoint.state_of(t.tid, incarnation=t.inc) is ConsumerState.PREEMPTED:
                    c.apply(c.endpoint.abort(t.tid, self.net.now))
        self.net.run(until=self.net.now + horizon)
        self._free_blocks()
        self.no_violation()
        for c in self.consumers:
            assert c.endpoint.num_transfers == 0
        for p in self.producers:
            assert p.endpoint.held_blocks() == {}, p.endpoint.held_blocks()
            assert p.endpoint.writes_in_flight() == []
        for p in self.net.producers.values():
            assert all(v == 1 for v in p.released_by_key.values())
        for n in (*self.consumers, *self.producers):  # rule 10: no staging leaked
            assert n.endpoint.staging_lent == 0, (n.peer, n.endpoint.staging_lent)


class PackedProtocol(Protocol):
    """The same machine with every write packed while staging lasts: a few
    transfers' worth, so that some registrations find none free and go direct."""

    PACKING = PackingConfig(mode="always", staging_bytes=8192, chunk_bytes=512)

    @rule(t=Protocol.transfers)
    def push(self, t):
        """Register and finish the prefill in one step, then let things move: more
        transfers reach their write (and their scatter) within the steps."""
        self.register(t)
        self.prefill(t)
        self.flow()


class ChunkedProtocol(PackedProtocol):
    """The packed machine with every packed write pipelined in chunks of 128 bytes:
    each chunk's notification is a frame of its own, delivered in any order, each
    chunk's scatter an item in flight; cancels, preemptions, reissues, failures and
    deaths land between them."""

    PACKING = PackingConfig(mode="always", staging_bytes=8192, chunk_bytes=512,
                            pipeline_bytes=128)


TestProtocol = Protocol.TestCase
TestProtocol.settings = settings(settings.default, stateful_step_count=50)
TestPackedProtocol = PackedProtocol.TestCase
TestPackedProtocol.settings = settings(settings.default, stateful_step_count=60)
TestChunkedProtocol = ChunkedProtocol.TestCase
TestChunkedProtocol.settings = settings(settings.default, stateful_step_count=60)
