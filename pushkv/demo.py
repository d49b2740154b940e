"""A guided tour of the protocol: a few pushes through the in-memory transport.

Each scenario runs real producer and consumer endpoints over the in-memory
transport (real byte buffers), prints what each side did and when, and checks
that the bytes that landed equal the source.
"""

from __future__ import annotations

from collections.abc import Callable

from .protocol import (
    IssueWrite,
    ReleaseDestination,
    ReleaseSource,
    SendMessage,
    TransferCancelled,
    TransferFailed,
    TransferReady,
    encode,
    uniform_ranks,
)
from .protocol.events import Action
from .transports.conformance import reference_destination
from .transports.inmemory import InMemoryNetwork, pair


def _describe(a: Action) -> str:
    if isinstance(a, SendMessage):
        m = a.message
        fields = f"{getattr(m, 'transfer_id', '')}#{getattr(m, 'attempt', '-')}"
        return f"send {type(m).__name__:<9} {fields:<8} -> {a.peer.engine_id}[{a.peer.rank}]"
    if isinstance(a, IssueWrite):
        return (f"WRITE     {a.transfer_id}#{a.attempt:<5} -> {a.peer.engine_id}[{a.peer.rank}] "
                f"({a.plan.descriptor_count} descriptors, {a.plan.nbytes} B)")
    if isinstance(a, ReleaseSource):
        return f"release source blocks {list(a.block_ids)} of {a.transfer_id}"
    if isinstance(a, ReleaseDestination):
        return f"release destination blocks {list(a.block_ids)} of {a.transfer_id}#{a.attempt}"
    if isinstance(a, TransferReady | TransferCancelled | TransferFailed):
        return f"{type(a).__name__.removeprefix('Transfer').upper():<9} {a.transfer_id}#{a.attempt}"
    return repr(a)


def _timeline(net: InMemoryNetwork) -> list[str]:
    rows = []
    for node in (*net.producers.values(), *net.consumers.values()):
        side = "prefill" if node.peer.engine_id == "prefill" else "decode "
        for t, a in node.log:
            rows.append((t, f"  {t * 1000:7.1f} ms  {side}[{node.peer.rank}]  {_describe(a)}"))
    return [r for _, r in sorted(rows, key=lambda x: x[0])]


def _net(p_tp: int = 1, d_tp: int = 1, heads: int = 0) -> InMemoryNetwork:
    heads = heads or max(p_tp, d_tp)
    net = pair(uniform_ranks("prefill", tp=p_tp, num_kv_heads=heads),
               uniform_ranks("decode", tp=d_tp, num_kv_heads=heads),
               latency=0.0005, write_latency=0.002, keep_log=True)
    return net


def _each(net: InMemoryNetwork, side: str) -> list:
    return list((net.producers if side == "p" else net.consumers).values())


def _register(net: InMemoryNetwork, tid: str, blocks: list[int], n: int, inc: int = 0) -> None:
    for c in _each(net, "c"):
        c.apply(c.endpoint.register(tid, "prefill", blocks, n, net.now, incarnation=inc))


def _prefill(net: InMemoryNetwork, tid: str, blocks: list[int], n: int, inc: int = 0) -> None:
    for p in _each(net, "p"):
        p.apply(p.endpoint.prefill_finished(tid, blocks, n, net.now, incarnation=inc))


def _bytes_ok(net: InMemoryNetwork, transfers: list) -> bool:
    pinfo = [p.info for p in _each(net, "p")]
    src = [p.memory for p in _each(net, "p")]
    import numpy as np

    return all(
        all(np.array_equal(w, g) for w, g in zip(
            reference_destination(pinfo, src, c.info, transfers), c.memory, strict=True))
        for c in _each(net, "c"))


def registration_first() -> tuple[InMemoryNetwork, list]:
    """Decode registers while prefill is still computing; the write follows prefill."""
    net = _net()
    _register(net, "req-1", [4, 5, 6], 40)
    net.advance(0.010)
    _prefill(net, "req-1", [10, 11, 12], 40)
    net.run()
    return net, [([10, 11, 12], [4, 5, 6], 40, 0)]


def prefill_first() -> tuple[InMemoryNetwork, list]:
    """Prefill finishes before decode registers; the write follows the registration."""
    net = _net()
    _prefill(net, "req-2", [10, 11, 12], 40)
    net.advance(0.010)
    _register(net, "req-2", [4, 5, 6], 40)
    net.run()
    return net, [([10, 11, 12], [4, 5, 6], 40, 0)]


def two_writers() -> tuple[InMemoryNetwork, list]:
    """Prefill TP 2 into decode TP 1: decode counts two notifications, in any order."""
    net = _net(p_tp=2)
    net.write_latency = 0.002
    _register(net, "req-3", [4, 5, 6], 40)
    net.advance(0.001)
    p0, p1 = _each(net, "p")
    p1.apply(p1.endpoint.prefill_finished("req-3", [10, 11, 12], 40, net.now))
    net.advance(0.005)
    p0.apply(p0.endpoint.prefill_finished("req-3", [10, 11, 12], 40, net.now))
    net.run()
    return net, [([10, 11, 12], [4, 5, 6], 40, 0)]


def preempt_and_reissue() -> tuple[InMemoryNetwork, list]:
    """Decode is preempted while waiting; its blocks come back only after the fence,
    then it re-registers new blocks with attempt 1, and only attempt 1 counts."""
    net = _net()
    _register(net, "req-4", [4, 5, 6], 40)
    net.advance(0.002)
    (c,) = _each(net, "c")
    c.apply(c.endpoint.preempt("req-4", net.now))
    net.advance(0.005)
    c.apply(c.endpoint.reissue("req-4", [20, 21, 22], net.now))
    net.advance(0.002)
    _prefill(net, "req-4", [10, 11, 12], 40)
    net.run()
    return net, [([10, 11, 12], [20, 21, 22], 40, 0)]


def cancel() -> tuple[InMemoryNetwork, list]:
    """Decode aborts the request; prefill acknowledges (the fence) and frees its KV."""
    net = _net()
    _register(net, "req-5", [4, 5, 6], 40)
    net.advance(0.002)
    (c,) = _each(net, "c")
    c.apply(c.endpoint.abort("req-5", net.now))
    net.advance(0.005)
    _prefill(net, "req-5", [10, 11, 12], 40)
    net.run()
    return net, []


def reused_id() -> tuple[InMemoryNetwork, list]:
    """The id of a finished request comes back at once for a new one. Each use has
    its own incarnation, so the old use's late duplicate notification is stale and
    only the new write completes the new transfer."""
    net = _net()
    _register(net, "req-6", [4, 5, 6], 40, inc=1001)
    _prefill(net, "req-6", [10, 11, 12], 40, inc=1001)
    net.run(until=net.now + 0.010)  # the first use is READY (its bytes land in pieces)
    (c,) = _each(net, "c")
    old = next(a.notify for _, a in _each(net, "p")[0].log if isinstance(a, IssueWrite))
    _register(net, "req-6", [20, 21, 22], 40, inc=1002)
    net.send(_each(net, "p")[0].peer, c.peer, encode(old))  # a late duplicate of the old one
    net.advance(0.005)
    _prefill(net, "req-6", [13, 14, 15], 40, inc=1002)
    net.run()
    return net, [([10, 11, 12], [4, 5, 6], 40, 0), ([13, 14, 15], [20, 21, 22], 40, 0)]


def replicated_head() -> tuple[InMemoryNetwork, list]:
    """Prefill TP 2 holds one KV head twice; decode TP 1 reads it from rank 0 only.
    Rank 1 writes nothing: decode's Skip tells it, and it frees its KV at once."""
    net = _net(p_tp=2, heads=1)
    _register(net, "req-7", [4, 5, 6], 40)
    net.advance(0.002)
    _prefill(net, "req-7", [10, 11, 12], 40)
    net.run()
    return net, [([10, 11, 12], [4, 5, 6], 40, 0)]


SCENARIOS: list[Callable[[], tuple[InMemoryNetwork, list]]] = [
    registration_first, prefill_first, two_writers, preempt_and_reissue, cancel, reused_id,
    replicated_head,
]


def run(print_fn: Callable[[str], None] = print) -> bool:
    """Run every scenario, print its timeline; True if every check held."""
    ok = True
    for scenario in SCENARIOS:
        net, transfers = scenario()
        doc = " ".join((scenario.__doc__ or "").split())
        print_fn(f"\n== {scenario.__name__.replace('_', ' ')}: {doc}")
        for row in _timeline(net):
            print_fn(row)
        good = _bytes_ok(net, transfers) and not net.violations
        leaks = any(c.endpoint.lent_blocks() for c in _each(net, "c")) or any(
            p.endpoint.held_blocks() for p in _each(net, "p"))
        print_fn(f"  -> bytes {'match the source' if good else 'WRONG'}, "
                 f"{'no blocks leaked' if not leaks else 'BLOCKS LEAKED'}")
        ok = ok and good and not leaks
    return ok
