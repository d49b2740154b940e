"""Engines pinned to a core each, the rest floating (``host.pinned``).

Each engine's loop runs on its side's core; any other piece starts on the core with
an idle core if there is one, else on a core drawn at random, and stays there until
it ends
(:class:`pushkv.sim.host.cores.PinnedCores`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import simpy
from sim_helpers import tiny_result

from pushkv.sim.host.cores import PinnedCores
from pushkv.sim.profile import ProfileError, profile_from_dict


def _ends(jobs: list[tuple[float, float, int | None]], *, cores: int = 2,
          seed: int = 0) -> list[float]:
    """When each (start, work, core) job ends on pinned ``cores`` (core None: floats)."""
    env = simpy.Environment()
    pool = PinnedCores(env, cores, np.random.default_rng(seed))
    ends = [math.nan] * len(jobs)

    def job(i: int, at: float, work: float, core: int | None):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield pool.run(work, core)
        ends[i] = env.now

    for i, (at, work, core) in enumerate(jobs):
        env.process(job(i, at, work, core))
    env.run()
    assert pool.runnable == 0
    assert pool.busy_s == pytest.approx(sum(w for _, w, _ in jobs))
    return ends


def test_two_engines_on_their_own_cores_run_at_full_speed() -> None:
    assert _ends([(0.0, 1.0, 0), (0.0, 1.0, 1)]) == pytest.approx([1.0, 1.0])


def test_two_pieces_pinned_to_one_core_share_it_while_the_other_idles() -> None:
    """What one pool never does: a core idles while two pieces wait on the other."""
    assert _ends([(0.0, 1.0, 1), (0.0, 1.0, 1)]) == pytest.approx([2.0, 2.0])


def test_a_floating_piece_takes_the_idle_core() -> None:
    """Decode steps on core 1; a frontend job starting meanwhile finds core 0 idle."""
    assert _ends([(0.0, 1.0, 1), (0.1, 0.5, None)]) == pytest.approx([1.0, 0.6])


@pytest.mark.parametrize("seed", range(6))
def test_a_floating_piece_beside_two_engines_halves_one_and_stays_there(seed: int) -> None:
    """Both engines step (1 s of work each) and a frontend job of 1 s starts with them:
    a tie, so it lands on one core, drawn; that core's engine and the job go at half
    pace. At 1 s the other engine is done and its core idles, but the job stays: the
    pair ends at 2 s, not at 1.5 as a pool (or a migrating kernel) would have it."""
    prefill, decode, job = _ends([(0.0, 1.0, 0), (0.0, 1.0, 1), (0.0, 1.0, None)], seed=seed)
    assert job == pytest.approx(2.0)
    assert sorted([prefill, decode]) == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize("seed", range(4))
def test_with_no_core_idle_a_floating_piece_lands_on_either_whatever_their_queues(
        seed: int) -> None:
    """Core 0 runs one piece, core 1 three: a piece floating in meanwhile finds no core
    idle and is drawn -- the kernel does not place a waking task by the queues' lengths
    now -- so across seeds it lands on the longer queue too."""
    landed = []
    for s in range(seed * 16, seed * 16 + 16):
        env = simpy.Environment()
        pool = PinnedCores(env, 2, np.random.default_rng(s))
        for core in (0, 1, 1, 1):
            pool.run(1.0, core)
        pool.run(1.0)
        landed.append(pool.pools[1].runnable == 4)
    assert any(landed) and not all(landed)


def test_ties_are_drawn_both_ways_and_the_same_way_from_the_same_seed() -> None:
    slowed = [_ends([(0.0, 1.0, 0), (0.0, 1.0, 1), (0.0, 1.0, None)], seed=s)[1] == 2.0
              for s in range(32)]
    assert any(slowed) and not all(slowed)
    assert slowed == [_ends([(0.0, 1.0, 0), (0.0, 1.0, 1), (0.0, 1.0, None)], seed=s)[1]
                      == 2.0 for s in range(32)]


def test_a_pinned_spinner_counts_as_a_runnable_piece_on_its_core() -> None:
    """A decode loop spinning on core 1 (holding a request): a floating job goes to core
    0 and runs at full speed; a piece pinned beside the spinner gets half the core."""
    env = simpy.Environment()
    pool = PinnedCores(env, 2, np.random.default_rng(0))
    spin = pool.spin(1.0, 1)
    ends: dict[str, float] = {}

    def job(name: str, work: float, core: int | None):  # type: ignore[no-untyped-def]
        yield pool.run(work, core)
        ends[name] = env.now

    env.process(job("floating", 1.0, None))
    env.process(job("pinned", 1.0, 1))
    env.run(until=5.0)
    pool.unspin(spin)
    pool.unspin(spin)  # a spinner stopped twice: nothing more
    assert ends == pytest.approx({"floating": 1.0, "pinned": 2.0})
    assert pool.runnable == 0


def test_bad_cores_are_refused() -> None:
    env = simpy.Environment()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="at least one core"):
            PinnedCores(env, bad, np.random.default_rng(0))  # type: ignore[arg-type]
    pool = PinnedCores(env, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="core 2 is not one of the host's 2"):
        pool.run(1.0, 2)
    with pytest.raises(ValueError, match="work must be >= 0"):
        pool.run(-1.0, 0)
    assert pool.runnable == 0


@pytest.mark.parametrize(("host", "match"), [
    ({"model": "shared-cpu", "pinned": True, "cores": 1}, r"host\.pinned needs host\.cores >= 2"),
    ({"model": "shared-cpu", "pinned": True}, r"host\.pinned needs host\.cores >= 2"),
    ({"pinned": True, "cores": 2}, r"host\.\w+ is a key of the shared-cpu host model"),
    ({"model": "shared-cpu", "pinned": 1, "cores": 2}, r"host\.pinned must be true or false"),
])
def test_a_pinned_host_needs_a_core_for_each_engine(host: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ProfileError, match=match):
        profile_from_dict({"host": host})


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_lone_request_takes_as_long_pinned_as_in_one_pool(mode: str) -> None:
    """Alone, a request's pieces never outnumber the cores: each frontend job finds an
    idle core, so pinning changes nothing -- the profile's lone times stand."""
    pool = tiny_result(mode, 1.0, 1, frontend_cores=1, cores=2)
    pinned = tiny_result(mode, 1.0, 1, frontend_cores=1, cores=2, pinned=True)
    assert pinned["ttfts"] == pytest.approx(pool["ttfts"], rel=1e-9)
    assert pinned["itls"] == pool["itls"]


def test_a_loaded_run_pinned_is_deterministic_and_not_the_pool() -> None:
    a = tiny_result("push", 100.0, 16, frontend_cores=1, cores=2, pinned=True)
    b = tiny_result("push", 100.0, 16, frontend_cores=1, cores=2, pinned=True)
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]
    assert a["completed"] == 16
    pool = tiny_result("push", 100.0, 16, frontend_cores=1, cores=2)
    assert a["ttfts"] != pool["ttfts"]

