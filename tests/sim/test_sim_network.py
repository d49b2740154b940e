"""The fabric against closed forms: fair sharing among posters, order within one."""

from __future__ import annotations

import dataclasses

import pytest

simpy = pytest.importorskip("simpy")

from pushkv.sim import costs  # noqa: E402
from pushkv.sim.network import Network  # noqa: E402
from pushkv.sim.profile import DEFAULT  # noqa: E402

#: One descriptor-bound transfer takes exactly ``W`` seconds alone (no wire latency).
NET = dataclasses.replace(DEFAULT.network, wire_latency_s=0.0)
SIZE, DESC = 4 << 20, 1000
W = costs.transfer_s(NET, SIZE, DESC, read=False)


def _finish_times(sharing: str, starts: list[tuple[float, str, str, str]]) -> list[float]:
    """Start a transfer (src, dst, poster) at each time; return when each ended."""
    env = simpy.Environment()
    net = Network(env, dataclasses.replace(NET, sharing=sharing))
    for node in ("p0", "p1", "d0", "d1"):
        net.add_node(node)
    ends: list[float] = [0.0] * len(starts)

    def one(i: int, at: float, src: str, dst: str, poster: str):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield env.process(net.transfer(src, dst, SIZE, DESC, read=False, poster=poster))
        ends[i] = env.now

    for i, (at, src, dst, poster) in enumerate(starts):
        env.process(one(i, at, src, dst, poster))
    env.run()
    return ends


def test_two_posters_share_one_link_equally() -> None:
    ends = _finish_times("fair", [(0.0, "p0", "d0", "a"), (0.0, "p1", "d0", "b")])
    assert ends == pytest.approx([2 * W, 2 * W])  # processor sharing: both at 2W
    assert _finish_times("fifo", [(0.0, "p0", "d0", "a"), (0.0, "p1", "d0", "b")]) == (
        pytest.approx([W, 2 * W]))


def test_a_late_flow_takes_half_the_link_from_then_on() -> None:
    ends = _finish_times("fair", [(0.0, "p0", "d0", "a"), (W / 2, "p1", "d0", "b")])
    # A: W/2 alone, then its last W/2 at half rate (W); B: W at half rate, then alone.
    assert ends == pytest.approx([1.5 * W, 2.0 * W])


def test_one_posters_transfers_go_out_in_order() -> None:
    ends = _finish_times("fair", [(0.0, "p0", "d0", "a"), (0.0, "p0", "d0", "a")])
    assert ends == pytest.approx([W, 2 * W])


def test_disjoint_links_do_not_share() -> None:
    ends = _finish_times("fair", [(0.0, "p0", "d0", "a"), (0.0, "p1", "d1", "b")])
    assert ends == pytest.approx([W, W])


def test_a_flow_runs_at_the_share_of_its_busiest_link() -> None:
    """p0->d0 and p1->d0 share d0's ingress; p0->d1 shares p0's egress with the first."""
    ends = _finish_times("fair", [(0.0, "p0", "d0", "a"), (0.0, "p1", "d0", "b"),
                                  (0.0, "p0", "d1", "c")])
    # Every flow has a link carrying two: all at half rate, all end at 2W.
    assert ends == pytest.approx([2 * W, 2 * W, 2 * W])
