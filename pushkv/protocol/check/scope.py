"""What one run of the model checker explores: a :class:`Scope`, and the named scopes.

A scope fixes the engines (tensor parallelism on each side, KV heads), how many
times one transfer id is used (incarnations, one after the other), how many
attempts each use may take (preempt then reissue), and which faults the
network and the engines may inject: dropped and duplicated frames, failed
writes, engines that die, aborts on either side. Every timeout is a small
whole number of seconds, so times stay exact and few.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import ConsumerConfig, ProducerConfig
from ..errors import ConfigError
from ..layout import RankInfo, uniform_ranks
from ..packing import PackingConfig

#: The write-visibility models a scope may use (see :attr:`Scope.visibility`).
VISIBILITY = ("adversarial", "eager")


@dataclass(frozen=True, slots=True, kw_only=True)
class Scope:
    """The bounds of one exhaustive exploration."""

    name: str = field(default="custom", metadata={"help": "shown in reports"})
    p_tp: int = field(default=1, metadata={"help": "producer tensor-parallel size"})
    d_tp: int = field(default=1, metadata={"help": "consumer tensor-parallel size"})
    kv_heads: int = field(
        default=0, metadata={"help": "KV heads of the model; 0: max(p_tp, d_tp) (split)"}
    )
    incarnations: int = field(
        default=1, metadata={"help": "uses of the one transfer id (of distinct ids with "
                             "distinct_ids)"})
    attempts: int = field(default=1, metadata={"help": "attempts per use (preempt+reissue)"})
    drops: int = field(default=0, metadata={"help": "frames the network may drop per path"})
    dups: int = field(default=0, metadata={"help": "frames the network may duplicate per path"})
    deaths: tuple[str, ...] = field(
        default=(), metadata={"help": "engines that may die: 'P', 'D' (one death per path)"}
    )
    write_errors: bool = field(default=False, metadata={"help": "writes may fail"})
    aborts: bool = field(default=True, metadata={"help": "the consumer engine may abort"})
    prefill_aborts: bool = field(
        default=False, metadata={"help": "the producer engine may abort a request"}
    )
    distinct_ids: bool = field(
        default=False,
        metadata={"help": "each use is its own transfer id (t0, t1, ...; incarnation 1), "
                  "and a use may start while the one before it is live: the uses share "
                  "the engines' block pools (blocks one frees are lent to another at once)"},
    )
    pull: bool = field(
        default=False,
        metadata={"help": "pull: the producer publishes its source, the consumer reads it "
                  "(a read takes the source's bytes at any time until it completes, what "
                  "they are at that moment); reads may fail with write_errors"},
    )
    abandons: bool = field(
        default=False,
        metadata={"help": "the consumer engine may end a later use of the id before "
                  "registering it, while the earlier use is live (abandon)"},
    )
    retarget: bool = field(
        default=False,
        metadata={"help": "rule 12: a router may re-target each use's held source, once, at "
                  "any moment, to a second decode engine E (one rank, turn 1; a sink: "
                  "its writes are checked against the source, its own memory is not "
                  "modelled). D stays the engine whose memory is checked"},
    )
    linger: bool = field(
        default=False,
        metadata={"help": "rule 12 after READY (with retarget): producers keep a source "
                  "written to D for hold_s (retarget_hold_s) until D reports its first "
                  "decode step (Consumed, each rank at any moment after READY, or never), "
                  "and the router may re-target a use D declared READY"},
    )
    hold_s: float = field(
        default=5.0, metadata={"help": "with linger: the producers' retarget_hold_s"}
    )
    heartbeats: bool = field(default=True, metadata={"help": "consumers renew leases"})
    publish_lag: bool = field(
        default=False,
        metadata={"help": "pull: a producer rank's core may be told of the finished prefill "
                  "after the clock moved on (else at the same instant, though after any "
                  "frame that reached it meanwhile)"})
    handshake: bool = field(
        default=False,
        metadata={"help": "handshake on demand (Connect), each rank pair may fail"},
    )
    pieces: int = field(
        default=0,
        metadata={"help": "the producer engine may report the KV final in this many ranges, "
                  "in any order, before prefill finishes (0: whole-request readiness)"},
    )
    split: str = field(
        default="tokens",
        metadata={"help": "what the ranges split: 'tokens' (all layers of each token) or "
                  "'layers' (all tokens of each layer)"},
    )
    staging_bytes: int = field(
        default=0,
        metadata={"help": "staging memory of every rank, in bytes (rule 10: packed writes, "
                  "always packed when it is free; 0: none, every write is direct)"},
    )
    pipeline_bytes: int = field(
        default=0,
        metadata={"help": "rule 10: packed writes are pipelined in chunks of this many "
                  "bytes, each notified and scattered on its own (0: one chunk)"},
    )
    d_blocks: int = field(default=2, metadata={"help": "consumer block pool (reused at once)"})
    p_blocks: int = field(default=1, metadata={"help": "producer block pool (reused at once)"})
    window_s: float = 4.0
    grace_s: float = 3.0
    lease_s: float = 6.0
    heartbeat_s: float = 3.0
    orphan_ttl_s: float = 8.0
    max_transit_s: float = field(
        default=1.0, metadata={"help": "a frame older than this is lost (timing assumption)"}
    )
    max_write_s: float = field(
        default=1.0, metadata={"help": "a write lands and completes within this"}
    )
    visibility: str = field(
        default="adversarial",
        metadata={"help": "when a write's bytes become visible: 'adversarial' (in pieces, "
                  "any time until its notification, independent of the producer's "
                  "completion; a failed write may land any part of itself) or 'eager' "
                  "(all at once, before the completion)"},
    )
    max_scatter_s: float = field(
        default=1.0,
        metadata={"help": "a consumer's scatter out of staging ends within this (rule 10: "
                  "the protocol waits for it however long it takes)"},
    )
    horizon_s: float = field(
        default=16.0,
        metadata={"help": "past this time, engines act on what they owe before a timer fires"},
    )
    time_limit_s: float = field(
        default=64.0, metadata={"help": "a timer still due past this is a liveness violation"}
    )

    def __post_init__(self) -> None:
        if self.incarnations < 1 or self.attempts < 1:
            raise ConfigError("a scope needs at least one incarnation and one attempt")
        if not set(self.deaths) <= {"P", "D"}:
            raise ConfigError(f"deaths must name 'P' or 'D', got {self.deaths!r}")
        if self.max_transit_s + self.max_write_s >= self.grace_s:
            raise ConfigError("the fence grace must exceed transit plus the longest write")
        if self.d_blocks < 1 or self.p_blocks < 1:
            raise ConfigError("block pools must hold at least one block")
        if self.distinct_ids and self.abandons:
            raise ConfigError("abandons end a later use of one transfer id: they need "
                              "distinct_ids off")
        if self.pull and (self.staging_bytes or self.pieces or self.handshake):
            raise ConfigError("pull reads whole requests directly: no staging, ranges or "
                              "handshakes on demand")
        if self.visibility not in VISIBILITY:
            raise ConfigError(f"visibility must be one of {', '.join(VISIBILITY)}, got "
                              f"{self.visibility!r}")
        if self.p_tp < 1 or self.d_tp < 1 or self.kv_heads < 0:
            raise ConfigError(f"TP sizes must be >= 1 and kv_heads >= 0, got p_tp="
                              f"{self.p_tp}, d_tp={self.d_tp}, kv_heads={self.kv_heads}")
        if self.retarget and (self.pull or self.staging_bytes or self.pieces or self.handshake):
            raise ConfigError("retarget is modelled for whole-request direct push writes")
        if self.linger and not (self.retarget and self.hold_s > 0):
            raise ConfigError("linger needs retarget and a hold_s above 0")
        if self.pieces < 0 or self.split not in ("tokens", "layers"):
            raise ConfigError(f"pieces must be >= 0 and split 'tokens' or 'layers', got "
                              f"{self.pieces!r} and {self.split!r}")

    @property
    def heads(self) -> int:
        return self.kv_heads or max(self.p_tp, self.d_tp)

    @property
    def tokens(self) -> int:
        """Tokens of the request: one, or one per range when the ranges split tokens."""
        return self.pieces if self.pieces > 1 and self.split == "tokens" else 1

    @property
    def layers(self) -> int:
        """Layers of the model: one, or one per range when the ranges split layers."""
        return self.pieces if self.pieces > 1 and self.split == "layers" else 1

    def piece(self, j: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """Range ``j``: its tokens ``[a, b)`` and layers ``[l0, l1)`` (None: all)."""
        if self.split == "tokens":
            return (j * self.tokens // self.pieces, (j + 1) * self.tokens // self.pieces), None
        return (0, self.tokens), (j * self.layers // self.pieces,
                                  (j + 1) * self.layers // self.pieces)

    def ranks(self) -> tuple[list[RankInfo], list[RankInfo]]:
        """Producer and consumer ranks: one byte per token, head and plane; a request
        fills one block (of :attr:`tokens` tokens, :attr:`layers` layers)."""
        def ranks(engine: str, tp: int, blocks: int) -> list[RankInfo]:
            return uniform_ranks(engine, tp=tp, num_blocks=blocks, num_layers=self.layers,
                                 num_kv_heads=self.heads, head_dim=1, dtype_bytes=1,
                                 block_size=self.tokens)

        return ranks("P", self.p_tp, self.p_blocks), ranks("D", self.d_tp, self.d_blocks)

    def retarget_rank(self) -> RankInfo:
        """Rule 12: the one rank of the engine E a held source may be re-targeted to."""
        (e,) = uniform_ranks("E", tp=1, num_blocks=1, num_layers=self.layers,
                             num_kv_heads=self.heads, head_dim=1, dtype_bytes=1,
                             block_size=self.tokens)
        return e

    def packing(self) -> PackingConfig | None:
        if not self.staging_bytes:
            return None
        return PackingConfig(mode="always", staging_bytes=self.staging_bytes, chunk_bytes=2,
                             pipeline_bytes=self.pipeline_bytes)

    def producer_config(self) -> ProducerConfig:
        return ProducerConfig(lease_s=self.lease_s, orphan_ttl_s=self.orphan_ttl_s,
                              max_pending_registrations=64, max_tombstones=64,
                              packing=self.packing(),
                              retarget_hold_s=self.hold_s if self.linger else 0.0)

    def consumer_config(self) -> ConsumerConfig:
        hb = self.heartbeat_s if self.heartbeats else self.horizon_s  # once, after the rest
        return ConsumerConfig(window_s=self.window_s, fence_grace_s=self.grace_s,
                              heartbeat_s=hb, packing=self.packing())

    def describe(self) -> str:
        faults = [f"{self.drops} drop(s)" if self.drops else "",
                  f"{self.dups} dup(s)" if self.dups else "",
                  f"death of {'/'.join(self.deaths)}" if self.deaths else "",
                  "write errors" if self.write_errors else "",
                  "consumer aborts" if self.aborts else "",
                  "producer aborts" if self.prefill_aborts else "",
                  "abandons of a later use" if self.abandons else "",
                  "distinct transfer ids at once" if self.distinct_ids else "",
                  "pull (reads of a published source)" if self.pull else "",
                  "publish lagging past timers" if self.pull and self.publish_lag else "",
                  "handshakes on demand" if self.handshake else "",
                  f"KV final in {self.pieces} {self.split} range(s)" if self.pieces else "",
                  f"packed writes ({self.staging_bytes} B staging)" if self.staging_bytes
                  else "",
                  f"pipelined in {self.pipeline_bytes} B chunks" if self.pipeline_bytes
                  else "",
                  "eager visibility" if self.visibility == "eager" else "",
                  "re-targeted to engine E (rule 12)" if self.retarget else ""]
        uses = (f"{self.incarnations} transfer id(s)" if self.distinct_ids
                else f"{self.incarnations} incarnation(s)")
        return (f"P TP{self.p_tp} -> D TP{self.d_tp}, {self.heads} KV head(s), "
                f"{uses} x {self.attempts} attempt(s); "
                + (", ".join(f for f in faults if f) or "no faults"))


def _scopes(*scopes: Scope) -> dict[str, Scope]:
    return {s.name: s for s in scopes}


#: The scopes CI runs to completion (see docs/protocol.md for what each proves).
CI_SCOPES = _scopes(
    Scope(name="1to1", attempts=2, heartbeats=False, prefill_aborts=True),
    Scope(name="1to1-net", dups=1, drops=1, prefill_aborts=True),
    Scope(name="1to1-faults", deaths=("P", "D"), write_errors=True, prefill_aborts=True),
    Scope(name="1to1-reuse", incarnations=2, dups=1, heartbeats=False, aborts=False),
    # A preempted attempt still fencing when its producer dies: no reissue can follow.
    Scope(name="1to1-preempt-death", attempts=2, deaths=("P",), heartbeats=False,
          aborts=False),
    Scope(name="abandon", incarnations=2, abandons=True, heartbeats=False, aborts=False),
    # Two transfer ids at once, one destination block: the second is lent the block the
    # first frees, while a failed write of the first may still land stray bytes.
    Scope(name="two-ids", incarnations=2, distinct_ids=True, d_blocks=1, write_errors=True,
          heartbeats=False, aborts=False),
    Scope(name="1to2", d_tp=2, dups=1, heartbeats=False),
    Scope(name="2to1", p_tp=2, dups=1, heartbeats=False),
    Scope(name="replicated", p_tp=2, kv_heads=1, prefill_aborts=True, deaths=("D",),
          heartbeats=False),
    Scope(name="replicated-reuse", p_tp=2, kv_heads=1, incarnations=2, heartbeats=False,
          aborts=False),
    Scope(name="handshake", p_tp=2, kv_heads=1, handshake=True, heartbeats=False),
    # Pull: reads of a published source, which take its bytes until they complete;
    # leases end, prefills abort, reads fail, either engine dies.
    Scope(name="pull", pull=True, attempts=2, write_errors=True, deaths=("P", "D"),
          prefill_aborts=True),
    Scope(name="pull-net", pull=True, attempts=2, dups=1, drops=1, prefill_aborts=True),
    Scope(name="pull-reuse", pull=True, incarnations=2, attempts=2, heartbeats=False,
          aborts=False),
    # Rule 9: the KV becomes final in two ranges, in any order, before prefill ends.
    Scope(name="partial", pieces=2, attempts=2, aborts=False, heartbeats=False),
    Scope(name="partial-faults", pieces=2, prefill_aborts=True, write_errors=True,
          deaths=("P", "D"), heartbeats=False),
    Scope(name="partial-net", pieces=2, split="layers", dups=1, drops=1, heartbeats=False),
    Scope(name="partial-2to1", p_tp=2, pieces=2, split="layers", aborts=False,
          heartbeats=False),
    Scope(name="partial-reuse", pieces=1, incarnations=2, aborts=False, heartbeats=False),
    # Rule 10: every write packed into staging and scattered by the consumer, which may
    # take long enough for the hard deadline to pass during a scatter.
    Scope(name="packed", attempts=2, dups=1, staging_bytes=128, max_scatter_s=4.0,
          heartbeats=False),
    Scope(name="packed-net", dups=1, drops=1, prefill_aborts=True, staging_bytes=128,
          max_scatter_s=4.0, heartbeats=False),
    Scope(name="packed-faults", attempts=2, deaths=("P", "D"), write_errors=True,
          staging_bytes=64, max_scatter_s=4.0, heartbeats=False),
    Scope(name="packed-2to1", p_tp=2, dups=1, staging_bytes=128, max_scatter_s=4.0,
          heartbeats=False),
    # Rule 10, pipelined: each write in chunks of one byte, each chunk notified and
    # scattered on its own while later chunks are still on their way.
    Scope(name="packed-chunked", attempts=2, dups=1, staging_bytes=128, pipeline_bytes=1,
          max_scatter_s=4.0, heartbeats=False),
    # Rule 12: the held source re-targeted to another engine at any moment, D dead or
    # alive (aborting), writes failing, prefill aborted.
    Scope(name="retarget", retarget=True, deaths=("D",), write_errors=True,
          prefill_aborts=True, heartbeats=False),
    # Rule 12 after READY: a written source lingers until D's first decode step is
    # reported (Consumed) or its hold ends; a re-target may come after READY too.
    Scope(name="retarget-linger", retarget=True, linger=True, deaths=("D",),
          write_errors=True, dups=1, heartbeats=False),
    Scope(name="packed-chunked-faults", attempts=2, deaths=("P", "D"), write_errors=True,
          staging_bytes=64, pipeline_bytes=1, max_scatter_s=4.0, heartbeats=False),
)

#: Deeper scopes for the benchmark and for people with time.
DEEP_SCOPES = _scopes(
    Scope(name="retarget-2to1-deep", retarget=True, p_tp=2, dups=1, heartbeats=False),
    Scope(name="retarget-reuse-deep", retarget=True, incarnations=2, heartbeats=False,
          aborts=False),
    # Rule 12's linger over two producer ranks: a D that gives up after one rank wrote
    # tells that rank (Consumed) so its source does not wait for the hold.
    Scope(name="retarget-linger-2to1-deep", retarget=True, linger=True, p_tp=2,
          heartbeats=False),
    Scope(name="1to1-deep", attempts=2, dups=1, drops=1, prefill_aborts=True,
          write_errors=True, deaths=("P", "D")),
    Scope(name="1to1-reuse-deep", incarnations=2, dups=1, drops=1, prefill_aborts=True),
    Scope(name="two-ids-deep", incarnations=2, distinct_ids=True, write_errors=True,
          heartbeats=False),
    Scope(name="pull-reuse-deep", pull=True, incarnations=2, attempts=2, write_errors=True,
          prefill_aborts=True, heartbeats=False),
    Scope(name="pull-2to1-deep", pull=True, p_tp=2, attempts=2, write_errors=True,
          prefill_aborts=True, heartbeats=False),
    # Rule 13, with a producer core told of the finished prefill after timers fired.
    Scope(name="pull-lag-deep", pull=True, attempts=2, write_errors=True, deaths=("P", "D"),
          prefill_aborts=True, publish_lag=True),
    Scope(name="2to1-deep", p_tp=2, attempts=2, dups=1, prefill_aborts=True),
    Scope(name="1to2-deep", d_tp=2, attempts=2, dups=1, prefill_aborts=True),
    Scope(name="replicated-reuse-deep", p_tp=2, kv_heads=1, incarnations=2, heartbeats=False),
    Scope(name="handshake-deep", p_tp=2, kv_heads=1, handshake=True, attempts=2, dups=1,
          heartbeats=False),
    Scope(name="partial-deep", pieces=2, attempts=2, prefill_aborts=True, heartbeats=False),
    Scope(name="partial-net-deep", pieces=2, split="layers", dups=1, drops=1,
          prefill_aborts=True),
    Scope(name="partial-reuse-deep", pieces=2, incarnations=2, aborts=False,
          heartbeats=False),
    Scope(name="partial-1to2-deep", d_tp=2, pieces=2, split="layers", heartbeats=False),
    Scope(name="packed-deep", attempts=2, dups=1, drops=1, prefill_aborts=True,
          write_errors=True, deaths=("P", "D"), staging_bytes=128, max_scatter_s=4.0),
    Scope(name="packed-1to2-deep", d_tp=2, attempts=2, dups=1, staging_bytes=128,
          max_scatter_s=4.0, heartbeats=False),
)

SCOPES = {**CI_SCOPES, **DEEP_SCOPES}


def scope(name: str, **overrides: object) -> Scope:
    """A named scope, with fields overridden (e.g. ``scope("1to1", dups=2)``)."""
    try:
        base = SCOPES[name]
    except KeyError as exc:
        raise ConfigError(f"unknown scope {name!r}; known: {', '.join(SCOPES)}") from exc
    return replace(base, **overrides)  # type: ignore[arg-type]
