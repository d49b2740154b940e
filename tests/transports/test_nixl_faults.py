"""The NIXL transport beyond the conformance suite: faults, handshakes, channels.

Same two-process set-up as ``test_nixl.py`` (one host process per engine).
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import ConsumerConfig, Hello, Notify, Register, encode, uniform_ranks
from pushkv.transports import conformance
from pushkv.transports.conformance import Topology, assert_clean, assert_destination
from pushkv.transports.nixl import NixlConfig
from pushkv.transports.nixl.sidechannel.channel import PeerCard, encode_card
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl


def _all(snap: conformance.Snapshot, ranks: list[int], tid: str, want: str) -> bool:
    return all(snap.outcome(r, tid) == want for r in ranks)


def _unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_producer_killed_mid_write(pool: HostPool) -> None:
    """The producer process dies while a large write is in flight: the consumer
    confirms the death and fails the transfer long before its window ends."""
    # NHD -> HND with 2 heads: one descriptor per (token, head, region) -> a slow write
    shape = {"num_kv_heads": 2, "num_layers": 4, "head_dim": 64, "num_blocks": 1100}
    topo = Topology(producer=dict(shape, order="NHD"), consumer=dict(shape, order="HND"),
                    consumer_config=ConsumerConfig(window_s=60.0, fence_grace_s=5.0,
                                                   heartbeat_s=0.5))
    c = NixlCluster(topo, pool)
    try:
        rng = np.random.default_rng(7)
        src = rng.permutation(1100)[:1024].tolist()
        dst = rng.permutation(1100)[:1024].tolist()
        c.register("big", dst, 16384)
        c.prefill_finished("big", src, 16384)
        end = time.monotonic() + 20
        while c.host_call("consumer", "landed", 0) == 0:  # the first bytes landed
            assert time.monotonic() < end, "the write never started"
        killed = time.monotonic()
        c.kill_producer()
        snap = c.wait(lambda s: _all(s, [0], "big", "failed") and not any(s.lent.values()),
                      15.0)
        took = time.monotonic() - killed
        assert snap.outcomes.get((0, "big")) == [("failed", 0)], snap.outcomes
        assert not any(snap.lent.values()), snap.lent
        assert took < 10.0, f"failure took {took:.1f} s (window is 60 s)"
        assert snap.dst_released.get((0, "big", 0)) == 1
    finally:
        c.close()


def test_garbage_on_the_side_channel(pool: HostPool) -> None:
    """Malformed messages, forged cards and a lying memory description are
    rejected and counted; no crash, and transfers still work after."""
    topo = Topology()
    c = NixlCluster(topo, pool)
    fake = uniform_ranks("decode-9")[0]
    hello = encode(Hello(info=fake))
    lo = fake.layout
    good_sizes = (lo.region_bytes,) * lo.num_regions
    cards = [
        PeerCard(hello=b"junk", address=_unused_address(), agent_name="x",
                 agent_metadata=b"", bases=(1,), sizes=(1,), kind="DRAM"),
        # memory too small for the advertised layout: a registration could point outside
        PeerCard(hello=hello, address=_unused_address(), agent_name="x", agent_metadata=b"m",
                 bases=(4096,) * lo.num_regions, sizes=(16,) * lo.num_regions, kind="DRAM"),
        # a plausible card whose NIXL metadata is garbage
        PeerCard(hello=hello, address=_unused_address(), agent_name="x",
                 agent_metadata=b"\x00" * 64, bases=(4096,) * lo.num_regions, sizes=good_sizes,
                 kind="DRAM"),
    ]
    messages = [[b"C"], [b"X", b"junk"], [b"C", b"a", b"b"], [b"H", b"not a card"],
                [b"B", b"tcp://127.0.0.1:1"], *([b"H", encode_card(k)] for k in cards)]
    forged = Register(transfer_id="f", attempt=0, engine_id="decode-9", rank=0,
                      producer_engine_id="prefill-0", block_ids=(1, 2), num_tokens=20)
    messages.append([b"C", encode(forged)])  # from a peer whose handshake failed
    # a Hello as a plain control frame must not introduce (or redefine) a peer
    bigger = uniform_ranks("decode-0", num_blocks=1 << 20)[0]
    messages.append([b"C", encode(Hello(info=bigger))])
    try:
        for parts in messages:
            c.send_raw(c.producer_addresses[0], parts)
            c.send_raw(c.consumer_addresses[0], parts)
        want = 2 * len(messages)
        snap = c.wait(lambda s: sum(s.rejected.values()) >= want, 10)
        assert snap.rejected[("producer", 0)] >= len(messages), snap.rejected
        assert snap.rejected[("consumer", 0)] >= len(messages), snap.rejected
        p, _ = c.raw_snapshot()
        assert p["stats"][0].get("peers_accepted", 0) == 1  # only the real consumer
        c.register("t", [4, 5, 6], 40)
        c.prefill_finished("t", [7, 8, 9], 40)
        snap = c.wait(lambda s: _all(s, [0], "t", "ready"), 10)
        assert _all(snap, [0], "t", "ready"), snap.outcomes
        assert_destination(c, [([7, 8, 9], [4, 5, 6], 40, 0)])
        assert_clean(c)
    finally:
        c.close()


def test_unanswered_handshake_fails_within_timeout(pool: HostPool) -> None:
    """A producer address where nobody answers: the transfer fails (blocks back)
    within the handshake timeout, and nothing hangs."""
    topo = Topology(consumer_config=ConsumerConfig(handshake_timeout_s=0.5))
    c = NixlCluster(topo, pool, connect="none")
    try:
        c.connect({0: _unused_address()})
        t0 = time.monotonic()
        c.register("t", [1, 2, 3], 40)
        snap = c.wait(lambda s: _all(s, [0], "t", "failed") and not any(s.lent.values()), 10)
        took = time.monotonic() - t0
        assert snap.outcomes.get((0, "t")) == [("failed", 0)], snap.outcomes
        assert snap.dst_released.get((0, "t", 0)) == 1
        assert 0.4 < took < 5.0, took
        _, cons = c.raw_snapshot()
        assert cons["fail_codes"][0, "t"] == ["HANDSHAKE_FAILED"]  # not a failed write
    finally:
        c.close()


def test_lazy_handshake_runs_once(pool: HostPool) -> None:
    """The handshake starts on the first registration and is reused after."""
    topo = Topology(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2})
    c = NixlCluster(topo, pool, connect="lazy")
    try:
        c.register("a", [4, 9, 2], 40)
        c.prefill_finished("a", [20, 3, 7], 40)
        snap = c.wait(lambda s: _all(s, [0], "a", "ready"), 20)
        assert _all(snap, [0], "a", "ready"), snap.outcomes
        c.prefill_finished("b", [30, 31, 32], 40)
        c.register("b", [10, 11, 12], 40)
        snap = c.wait(lambda s: _all(s, [0], "b", "ready"), 20)
        assert _all(snap, [0], "b", "ready"), snap.outcomes
        assert_destination(c, [([20, 3, 7], [4, 9, 2], 40, 0),
                               ([30, 31, 32], [10, 11, 12], 40, 0)])
        _, cons = c.raw_snapshot()
        assert cons["stats"][0]["handshakes_started"] == 1
        assert cons["stats"][0]["handshakes_done"] == 1
        assert_clean(c)
    finally:
        c.close()


@pytest.mark.parametrize("name", ["either_order", "reissue_after_kv", "cancel",
                                  "transfer_tp2-1"])
def test_control_over_nixl_notifications(pool: HostPool, name: str) -> None:
    """Registrations, cancels, acks and fails sent as NIXL notifications."""
    fn, kwargs = conformance.CHECKS[name]
    cfg = NixlConfig(control_channel="nixl")
    fn(lambda topo: NixlCluster(topo, pool, cfg), **kwargs)


def test_reused_transfer_id_is_a_new_transfer(pool: HostPool) -> None:
    """A transfer id used again with a new incarnation: a late duplicate of the old
    write notification (a real NIXL notification) does not complete the new one,
    and the new one's bytes land."""
    c = NixlCluster(Topology(), pool)
    try:
        c.register("r", [4, 5, 6], 40, incarnation=11)
        c.prefill_finished("r", [7, 8, 9], 40, incarnation=11)
        snap = c.wait(lambda s: s.outcome(0, "r") == "ready", 10)
        assert snap.outcomes.get((0, "r")) == [("ready", 0)], snap.outcomes
        c.register("r", [20, 21, 22], 40, incarnation=12)
        _, cons = c.raw_snapshot()
        seen = cons["stats"][0].get("notifications", 0)
        old = Notify(transfer_id="r", attempt=0, engine_id="prefill-0", rank=0, incarnation=11)
        c.inject("consumer", 0, "notify", encode(old))
        end = time.monotonic() + 10
        while cons["stats"][0].get("notifications", 0) <= seen:  # it arrived...
            assert time.monotonic() < end, "the injected notification never arrived"
            _, cons = c.raw_snapshot(0.01)
        snap = c.snapshot()  # ...and changed nothing
        assert snap.outcomes.get((0, "r")) == [("ready", 0)], snap.outcomes
        assert snap.lent[0], "the new incarnation's blocks must still be lent"
        c.prefill_finished("r", [30, 31, 32], 40, incarnation=12)
        snap = c.wait(lambda s: s.outcomes.get((0, "r")) == [("ready", 0)] * 2, 10)
        assert snap.outcomes.get((0, "r")) == [("ready", 0)] * 2, snap.outcomes
        assert_destination(c, [([7, 8, 9], [4, 5, 6], 40, 0),
                               ([30, 31, 32], [20, 21, 22], 40, 0)])
        snap = c.wait(lambda s: not any(s.lent.values()) and not any(s.held.values()), 10)
        assert not any(snap.lent.values()) and not any(snap.held.values())
        assert snap.src_released.get((0, "r")) == 2  # once per incarnation
        assert not snap.violations, snap.violations
    finally:
        c.close()


def test_abandon_releases_the_source_at_once(pool: HostPool) -> None:
    """A decode request that ended before registering: the producer's source is
    released now, not when its lease (30 s) runs out."""
    c = NixlCluster(Topology(), pool)
    try:
        c.prefill_finished("a", [7, 8, 9], 40, incarnation=5)
        snap = c.wait(lambda s: bool(s.held.get(0)), 10)
        assert snap.held.get(0), snap.held
        c.abandon("a", incarnation=5)
        snap = c.wait(lambda s: s.src_released.get((0, "a")) == 1, 10)
        assert snap.src_released.get((0, "a")) == 1, snap.src_released
        assert_clean(c)
    finally:
        c.close()
