"""The conformance-suite :class:`~pushkv.transports.conformance.Cluster` over real NIXL.

The producer engine and the consumer engine live in two **separate spawned
processes** (:class:`Host`); every rank is a :class:`~.runtime.api.NixlRuntime` with
its own NIXL agent, so TP 2 means two agents in a process. The parent drives
the hosts over a ``multiprocessing`` pipe: engine-level calls go to every rank
of the engine, snapshots are gathered from the events each rank reported.

Hosts are reusable: :class:`HostPool` keeps one producer host and one consumer
host alive across clusters (start-up -- importing NIXL, the first agent --
costs seconds) and replaces a host that was killed. Each cluster creates fresh
runtimes, so checks stay independent; closing a cluster closes its runtimes
and fails if any runtime thread is left behind.

Raw frames go into a rank's ``"control"`` channel from the parent's own zmq
socket, and into its ``"notify"`` channel as a NIXL notification sent by a
rank of the other engine.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pushkv.protocol import (
    Mode,
    Peer,
    Publish,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)

from ..conformance import Snapshot, Topology

PRODUCER, CONSUMER = "prefill-0", "decode-0"
_SETUP_TIMEOUT = 60.0
_CALL_TIMEOUT = 60.0


def pattern(region: int, size: int) -> np.ndarray:
    """Deterministic source bytes of one KV region (cheap to recompute in any process)."""
    return ((np.arange(size, dtype=np.uint32) * 7 + region * 13) % 251).astype(np.uint8)


def blocks_match(memory: Sequence[np.ndarray], block_bytes: int, src: Sequence[int],
                 dst: Sequence[int]) -> bool:
    """Whether destination blocks ``dst`` of every region hold what :func:`pattern`
    put in source blocks ``src``; every region is zeroed after (for the next round)."""
    ok = True
    for r, region in enumerate(memory):
        want = pattern(r, region.size).reshape(-1, block_bytes)[list(src)]
        ok &= bool(np.array_equal(region.reshape(-1, block_bytes)[list(dst)], want))
        region.fill(0)
    return ok


def wait_for_event(rt: Any, kind: str, transfer_id: str, timeout_s: float = 60.0) -> Any:
    """Poll a :class:`~.runtime.api.NixlRuntime` until an event of type ``kind`` (its class
    name) for ``transfer_id`` comes, and return it. A ``TransferFailed`` or
    ``CallFailed`` raises RuntimeError; nothing within ``timeout_s``, TimeoutError."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for e in rt.poll():
            if type(e).__name__ == kind and getattr(e, "transfer_id", None) == transfer_id:
                return e
            if type(e).__name__ in ("TransferFailed", "CallFailed"):
                raise RuntimeError(repr(e))
        rt.wait(0.01)
    raise TimeoutError(f"no {kind} for {transfer_id} within {timeout_s:g} s")


# ===================================================================== child


class _RankState:
    """One runtime in a host and what it reported."""

    def __init__(self, runtime: Any, memory: list[np.ndarray]) -> None:
        self.runtime = runtime
        self.memory = memory
        self.outcomes: dict[str, list[tuple[str, int]]] = {}
        self.fail_codes: dict[str, list[str]] = {}  #: FailReason names, by transfer
        self.dst_released: Counter[tuple[str, int]] = Counter()
        self.src_released: Counter[str] = Counter()
        self.rejected = 0
        self.errors: list[str] = []
        #: producer (pull): (transfer id, incarnation) -> published block ids
        self.published: dict[tuple[str, int], list[int]] = {}
        #: producer (pull): (transfer id, incarnation) -> the publication's seal (rule 11)
        self.seals: dict[tuple[str, int], bytes] = {}
        #: producer: (transfer id, incarnation, consumer rank) of the registrations
        #: taken in (gathered from the runtime's recent ones at each snapshot)
        self.registrations: set[tuple[str, int, int]] = set()

    def drain(self) -> int:
        events = self.runtime.poll()
        for e in events:
            if isinstance(e, TransferReady):
                self.outcomes.setdefault(e.transfer_id, []).append(("ready", e.attempt))
            elif isinstance(e, TransferFailed):
                self.outcomes.setdefault(e.transfer_id, []).append(("failed", e.attempt))
                self.fail_codes.setdefault(e.transfer_id, []).append(e.code.name)
            elif isinstance(e, TransferCancelled):
                self.outcomes.setdefault(e.transfer_id, []).append(("cancelled", e.attempt))
            elif isinstance(e, ReleaseDestination):
                self.dst_released[e.transfer_id, e.attempt] += 1
            elif isinstance(e, ReleaseSource):
                self.src_released[e.transfer_id] += 1
            elif isinstance(e, Rejected):
                self.rejected += 1
            elif isinstance(e, Publish):
                self.published[e.transfer_id, e.incarnation] = list(e.block_ids)
                self.seals[e.transfer_id, e.incarnation] = e.seal
            elif type(e).__name__ == "CallFailed":
                self.errors.append(repr(e))
        return len(events)


class _HostServer:
    """Runs in the child: owns the runtimes of one engine."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.ranks: dict[int, _RankState] = {}

    def setup(self, topo: Topology, peer_addresses: dict[int, str] | None,
              config: Any = None, packing: Any = None) -> dict[int, str]:
        from dataclasses import replace

        from ..inmemory import region_memory
        from .runtime.api import NixlRuntime

        self.close()
        if packing is not None:  # staging memory on every rank, this PackingConfig
            topo = replace(topo, producer_config=replace(topo.producer_config, packing=packing),
                           consumer_config=replace(topo.consumer_config, packing=packing))
        if self.role == "producer":
            infos = topo.producer_ranks()
            rng = np.random.default_rng(topo.seed)  # the same bytes as the in-memory pair()
            mems = [region_memory(i.layout, rng=rng) for i in infos]
        else:
            infos = topo.consumer_ranks()
            mems = [region_memory(i.layout) for i in infos]
        for info, mem in zip(infos, mems, strict=True):
            rt = NixlRuntime(info, mem, role=self.role, config=config,  # type: ignore[arg-type]
                             producer_config=topo.producer_config,
                             consumer_config=topo.consumer_config)
            self.ranks[info.rank] = _RankState(rt, mem)
        if peer_addresses is not None:
            for st in self.ranks.values():
                st.runtime.connect(PRODUCER, peer_addresses, eager=True)
            end = time.monotonic() + _SETUP_TIMEOUT
            pause = threading.Event()
            while not all(st.runtime.connected(PRODUCER) for st in self.ranks.values()):
                if time.monotonic() > end:
                    raise TimeoutError("handshake with the producer engine did not complete")
                pause.wait(0.002)
        return {r: st.runtime.address for r, st in self.ranks.items()}

    def each(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
             ) -> None:
        for st in self.ranks.values():
            getattr(st.runtime, method)(*args, **(kwargs or {}))

    def connect(self, engine_id: str, addresses: dict[int, str], eager: bool) -> None:
        for st in self.ranks.values():
            st.runtime.connect(engine_id, addresses, eager=eager)

    def snapshot(self, wait_s: float) -> dict[str, Any]:
        got = sum(st.drain() for st in self.ranks.values())
        if not got and wait_s > 0 and self.ranks:
            first = next(iter(self.ranks.values()))
            end = time.monotonic() + wait_s
            while not got and time.monotonic() < end:
                first.runtime.wait(min(0.002, max(0.0, end - time.monotonic())))
                got = sum(st.drain() for st in self.ranks.values())
        out: dict[str, Any] = {"outcomes": {}, "src_released": {}, "dst_released": {},
                               "rejected": {}, "lent": {}, "held": {}, "errors": [],
                               "stats": {}, "writes_in_flight": 0, "transfers": {},
                               "fail_codes": {}, "published": {}, "seals": {},
                               "staging_lent": {},
                               "registrations": {}, "writes": {}}
        for r, st in self.ranks.items():
            view = st.runtime.inspect()
            out["rejected"][r] = st.rejected
            out["errors"] += st.errors
            out["stats"][r] = view.stats
            out.setdefault("endpoint_stats", {})[r] = view.endpoint_stats
            out["transfers"][r] = view.transfers
            out["staging_lent"][r] = view.staging_lent
            for tid, codes in st.fail_codes.items():
                out["fail_codes"][r, tid] = list(codes)
            out["writes_in_flight"] += view.writes_in_flight
            if self.role == "consumer":
                for tid, seen in st.outcomes.items():
                    out["outcomes"][r, tid] = list(seen)
                for (tid, a), n in st.dst_released.items():
                    out["dst_released"][r, tid, a] = n
                out["lent"][r] = dict(view.lent)
            else:
                for tid, n in st.src_released.items():
                    out["src_released"][r, tid] = n
                out["held"][r] = sorted(view.held)
                st.registrations.update(view.recent_registrations)
                out["registrations"][r] = sorted(st.registrations)
                out["writes"][r] = view.stats.get("writes_issued", 0)
                for key, ids in st.published.items():
                    out["published"][r, *key] = ids
                    out["seals"][r, *key] = st.seals.get(key, b"")
        return out

    def memory(self, rank: int) -> list[bytes]:
        return [bytes(m) for m in self.ranks[rank].memory]

    def landed(self, rank: int) -> int:
        """Non-zero bytes in a rank's memory (how much of a write has landed)."""
        return sum(int(np.count_nonzero(m)) for m in self.ranks[rank].memory)

    def inject(self, rank: int, peer: Peer, frame: bytes, channel: str) -> None:
        self.ranks[rank].runtime.inject(peer, frame, channel)

    def timeline(self, directory: str | None) -> None:
        """Record this process's timeline (protocol steps too) under ``directory``
        from now on (None: stop)."""
        from pushkv import timeline

        timeline.configure(None)
        timeline.configure(directory, f"{self.role}-host")

    def close(self) -> list[str]:
        """Close every runtime; names of pushkv threads still alive afterwards."""
        for st in self.ranks.values():
            st.runtime.close()
        self.ranks.clear()
        return [t.name for t in threading.enumerate() if t.name.startswith("pushkv-")]


def _host_main(conn: mpc.Connection, role: str) -> None:
    server = _HostServer(role)
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            break
        if op == "exit":
            server.close()
            conn.send(("ok", None))
            break
        try:
            result = getattr(server, op)(*args)
        except BaseException:
            conn.send(("err", traceback.format_exc()))
        else:
            conn.send(("ok", result))


# ==================================================================== parent


class HostError(RuntimeError):
    """A host process failed a call or died."""


class Host:
    """A spawned process hosting the runtimes of one engine."""

    def __init__(self, role: str) -> None:
        ctx = mp.get_context("spawn")
        self.role = role
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_host_main, args=(child, role), daemon=True,
                                 name=f"pushkv-host-{role}")
        self._proc.start()
        child.close()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def send(self, op: str, *args: Any) -> None:
        self._conn.send((op, args))

    def recv(self, timeout_s: float = _CALL_TIMEOUT) -> Any:
        if not self._conn.poll(timeout_s):
            raise HostError(f"{self.role} host did not answer within {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise HostError(f"{self.role} host died") from exc
        if status != "ok":
            raise HostError(f"{self.role} host failed:\n{value}")
        return value

    def call(self, op: str, *args: Any, timeout_s: float = _CALL_TIMEOUT) -> Any:
        self.send(op, *args)
        return self.recv(timeout_s)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join(10)
        self._conn.close()

    def stop(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(HostError, OSError):
                self.call("exit", timeout_s=30)
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10)
        self._conn.close()


class HostPool:
    """One producer host and one consumer host, replaced when killed."""

    def __init__(self) -> None:
        self._hosts: dict[str, Host] = {}

    def get(self, role: str) -> Host:
        host = self._hosts.get(role)
        if host is None or not host.alive:
            host = self._hosts[role] = Host(role)
        return host

    def close(self) -> None:
        for host in self._hosts.values():
            host.stop()
        self._hosts.clear()


class NixlCluster:
    """A :class:`~pushkv.transports.conformance.Cluster` whose engines are real processes."""

    stages_source = False  # the source memory lives in the producer processes

    def __init__(self, topology: Topology, pool: HostPool, config: Any = None, *,
                 connect: str = "eager", consumer_nixl: Any = None,
                 packing: Any = None) -> None:
        """``config``: the ranks' :class:`NixlConfig` (``consumer_nixl``: the consumer's,
        if it differs). ``connect``: ``"eager"`` (handshake before returning),
        ``"lazy"`` (addresses given, handshake on first register) or ``"none"`` (see
        :meth:`connect`). ``packing``: a :class:`~pushkv.protocol.PackingConfig` for
        every rank's endpoint (staging memory, packed writes)."""
        self.topology = topology
        self._producer = pool.get("producer")
        self._consumer = pool.get("consumer")
        self._producer_dead = False
        self._last_producer: dict[str, Any] = {}
        self._sources: dict[int, list[np.ndarray]] = {}
        self._zmq: Any = None
        self._pushes: dict[str, Any] = {}
        self.producer_addresses: dict[int, str] = self._producer.call(
            "setup", topology, None, config, packing, timeout_s=_SETUP_TIMEOUT)
        self.consumer_addresses: dict[int, str] = self._consumer.call(
            "setup", topology, self.producer_addresses if connect == "eager" else None,
            consumer_nixl if consumer_nixl is not None else config, packing,
            timeout_s=_SETUP_TIMEOUT)
        if connect == "lazy":
            self.connect(self.producer_addresses)

    def connect(self, addresses: dict[int, str], eager: bool = False) -> None:
        """Give every consumer rank producer addresses (any: a test may lie)."""
        self._consumer.call("connect", PRODUCER, addresses, eager)

    # ----------------------------------------------------- engine-level calls

    def register(self, transfer_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                 first_token: int = 0, *, incarnation: int = 0) -> None:
        self._consumer.call("each", "register", (transfer_id, PRODUCER, list(dst_block_ids),
                                                 num_tokens, first_token),
                            {"incarnation": incarnation})

    def abandon(self, transfer_id: str, *, incarnation: int = 0) -> None:
        self._consumer.call("each", "abandon", (transfer_id, PRODUCER),
                            {"incarnation": incarnation})

    def prefill_finished(self, transfer_id: str, src_block_ids: Sequence[int],
                         num_tokens: int, *, incarnation: int = 0) -> None:
        self._producer.call("each", "prefill_finished",
                            (transfer_id, list(src_block_ids), num_tokens),
                            {"incarnation": incarnation})

    def range_ready(self, transfer_id: str, src_block_ids: Sequence[int],
                    tokens: tuple[int, int], layers: tuple[int, int] | None = None) -> None:
        self._producer.call("each", "range_ready", (transfer_id, list(src_block_ids),
                                                    tuple(tokens)), {"layers": layers})

    def publish(self, transfer_id: str, src_block_ids: Sequence[int], num_tokens: int, *,
                incarnation: int = 0) -> None:
        """Pull: prefill finished; every producer rank publishes ``src_block_ids``."""
        self._producer.call("each", "prefill_finished",
                            (transfer_id, list(src_block_ids), num_tokens),
                            {"incarnation": incarnation, "mode": Mode.PULL})

    def start_pull(self, transfer_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                   first_token: int = 0, *, incarnation: int = 0,
                   src_block_ids: Sequence[int] | None = None,
                   timeout_s: float = 20.0, lease_s: float | None = None,
                   seals: dict[int, bytes] | None = None) -> None:
        """Pull, as a sequential router does it: wait until every producer rank
        published the transfer, then have every consumer rank read the published
        block ids (or ``src_block_ids``, when a test lies about them) with each
        rank's seal (rule 11; or ``seals``, when a test lies about them)."""
        if src_block_ids is None:
            ranks = [p.rank for p in self.topology.producer_ranks()]
            end = time.monotonic() + timeout_s
            while True:
                part = self._parts(0.01)[0]
                published = part.get("published", {})
                got = [published.get((r, transfer_id, incarnation)) for r in ranks]
                if all(g is not None for g in got):
                    break
                if time.monotonic() >= end:
                    raise TimeoutError(f"{transfer_id} was never published: {published}")
            src_block_ids = got[0]
            if seals is None:
                sealed = {r: part.get("seals", {}).get((r, transfer_id, incarnation), b"")
                          for r in ranks}
                seals = sealed if all(sealed.values()) else None
        self._consumer.call("each", "start_pull",
                            (transfer_id, PRODUCER, list(src_block_ids), list(dst_block_ids),
                             num_tokens, first_token),
                            {"incarnation": incarnation, "lease_s": lease_s, "seals": seals})

    def preempt(self, transfer_id: str) -> None:
        self._consumer.call("each", "preempt", (transfer_id,))

    def reissue(self, transfer_id: str, dst_block_ids: Sequence[int]) -> None:
        self._consumer.call("each", "reissue", (transfer_id, list(dst_block_ids)))

    def abort(self, transfer_id: str) -> None:
        self._consumer.call("each", "abort", (transfer_id,))

    def consumed(self, transfer_id: str) -> None:
        self._consumer.call("each", "consumed", (transfer_id,))

    def prefill_aborted(self, transfer_id: str, *, incarnation: int = 0) -> None:
        self._producer.call("each", "prefill_aborted", (transfer_id,),
                            {"incarnation": incarnation})

    # ----------------------------------------------------------------- faults

    def inject(self, side: str, rank: int, channel: str, frame: bytes) -> None:
        addresses = self.producer_addresses if side == "producer" else self.consumer_addresses
        if channel == "control":
            self.send_raw(addresses[rank], [b"C", frame])
        elif side == "consumer":  # a NIXL notification from producer rank 0
            self._producer.call("inject", min(self.producer_addresses), Peer(CONSUMER, rank),
                                frame, "notify")
        else:
            self._consumer.call("inject", min(self.consumer_addresses), Peer(PRODUCER, rank),
                                frame, "notify")

    def send_raw(self, address: str, parts: list[bytes]) -> None:
        """Any multipart message onto a rank's side channel, from the parent."""
        import zmq

        if self._zmq is None:
            self._zmq = zmq.Context()
        sock = self._pushes.get(address)
        if sock is None:
            sock = self._pushes[address] = self._zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
        sock.send_multipart(parts)

    def host_call(self, role: str, op: str, *args: Any) -> Any:
        """Call a host operation directly (``landed``, ``snapshot``, ...)."""
        return (self._producer if role == "producer" else self._consumer).call(op, *args)

    def kill_producer(self) -> None:
        """SIGKILL the producer process (its last reported state is kept)."""
        self._producer.kill()
        self._producer_dead = True

    # --------------------------------------------------------------- watching

    def _parts(self, wait_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        self._consumer.send("snapshot", wait_s)
        if not self._producer_dead:
            self._producer.send("snapshot", wait_s)
        c = self._consumer.recv()
        if self._producer_dead:
            p = dict(self._last_producer, held={})
        else:
            p = self._last_producer = self._producer.recv()
        return p, c

    def raw_snapshot(self, wait_s: float = 0.0) -> tuple[dict[str, Any], dict[str, Any]]:
        """The hosts' reports as dicts (stats, writes in flight, errors)."""
        return self._parts(wait_s)

    def staging_report(self, wait_s: float = 0.2) -> dict[str, Any]:
        """Packed writes so far: staging each rank still lends (``lent``, bytes by
        ``(role, rank)``; a dead producer's excused in ``leaked``), writes packed and
        scatters done, summed over ranks."""
        p, c = self.raw_snapshot(wait_s)
        lent = {("producer", r): n for r, n in p.get("staging_lent", {}).items()}
        lent |= {("consumer", r): n for r, n in c["staging_lent"].items()}
        stats = [*p.get("stats", {}).values(), *c["stats"].values()]
        return {
            "lent": lent,
            "leaked": {k: n for k, n in lent.items()
                       if n and not (self._producer_dead and k[0] == "producer")},
            "packed": sum(s.get("writes_packed", 0) for s in stats),
            "scattered": sum(s.get("scatters_ok", 0) for s in stats),
        }

    def _snapshot(self, wait_s: float) -> Snapshot:
        p, c = self._parts(wait_s)
        rejected = {("producer", r): n for r, n in p.get("rejected", {}).items()}
        rejected |= {("consumer", r): n for r, n in c["rejected"].items()}
        return Snapshot(
            outcomes=c["outcomes"], src_released=p.get("src_released", {}),
            dst_released=c["dst_released"], rejected=rejected, lent=c["lent"],
            held=p.get("held", {}), registrations=p.get("registrations", {}),
            writes=p.get("writes", {}),
            violations=[f"call failed: {e}" for e in p.get("errors", []) + c["errors"]],
        )

    def snapshot(self) -> Snapshot:
        return self._snapshot(0.0)

    def wait(self, predicate: Callable[[Snapshot], bool], timeout_s: float) -> Snapshot:
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            snap = self._snapshot(max(0.0, min(0.01, left)))
            if predicate(snap) or time.monotonic() >= end:
                return snap

    def source_memory(self, rank: int) -> list[np.ndarray]:
        if rank not in self._sources:
            raw = self._producer.call("memory", rank)
            self._sources[rank] = [np.frombuffer(b, dtype=np.uint8) for b in raw]
        return self._sources[rank]

    def destination_memory(self, rank: int) -> list[np.ndarray]:
        return [np.frombuffer(b, dtype=np.uint8) for b in self._consumer.call("memory", rank)]

    def close(self) -> None:
        """Close every runtime; AssertionError if a runtime thread survives."""
        leftovers: list[str] = []
        for host, dead in ((self._consumer, False), (self._producer, self._producer_dead)):
            if not dead and host.alive:
                leftovers += host.call("close")
        for sock in self._pushes.values():
            sock.close()
        self._pushes.clear()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None
        if leftovers:
            raise AssertionError(f"runtime threads left behind: {leftovers}")


def host_pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
