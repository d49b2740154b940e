"""One core shared by ticks, as the kernel's fair scheduler shares it (``host.tick_s``).

:class:`pushkv.sim.host.fair.FairCore`: one piece runs at a time; a process's pieces
carry its virtual runtime; a piece that took the core keeps it for its slice; at each
tick a running piece whose slice is over yields to the one furthest behind.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import tiny_result

from pushkv.sim.host.cores import PinnedCores, SharedCores
from pushkv.sim.host.fair import FairCore, base_slice_s
from pushkv.sim.profile import ProfileError, profile_from_dict

MS = 1e-3


def _ends(core: FairCore | SharedCores,
          jobs: list[tuple[float, float, str | None]]) -> list[float]:
    """When each (start, work, process) job ends on ``core``."""
    env = core.env
    ends = [math.nan] * len(jobs)

    def job(i: int, at: float, work: float, process: str | None):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield core.run(work, process=process)
        ends[i] = env.now

    for i, (at, work, process) in enumerate(jobs):
        env.process(job(i, at, work, process))
    env.run()
    assert core.runnable == 0
    assert core.busy_s == pytest.approx(sum(w for _, w, _ in jobs))
    for name in {p for _, _, p in jobs}:  # each process served exactly its work
        assert core.busy_by_process[name or ""] == pytest.approx(
            sum(w for _, w, p in jobs if p == name))
    return ends


def test_two_cpu_bound_processes_take_turns_of_a_tick_not_half_a_core_each() -> None:
    """8 ms each from 0, ticks of 4 ms: one runs 0-4, the other 4-12 (its slice renewed
    at 8 and, tied with the first, it keeps the core), the first 12-16. Processor
    sharing ends both at 16."""
    ends = _ends(FairCore(simpy.Environment(), 4 * MS),
                 [(0.0, 8 * MS, "a"), (0.0, 8 * MS, "b")])
    assert sorted(ends) == pytest.approx([12 * MS, 16 * MS])
    assert _ends(SharedCores(simpy.Environment(), 1),
                 [(0.0, 8 * MS, "a"), (0.0, 8 * MS, "b")]) == pytest.approx([16 * MS] * 2)


def test_a_piece_arriving_while_the_running_one_holds_its_slice_waits_for_the_tick() -> None:
    """A long piece takes the core at 0 (slice 4 ms); a short one of a process far behind
    arrives at 1 ms: the slice is not over, so it waits for the tick at 4 ms."""
    env = simpy.Environment()
    core = FairCore(env, 4 * MS, slice_s=4 * MS)
    ends = _ends(core, [(0.0, 20 * MS, "engine"), (1 * MS, 0.5 * MS, "api")])
    assert ends == pytest.approx([20.5 * MS, 4.5 * MS])
    assert core.preemptions == 0


def test_a_piece_behind_takes_the_core_at_once_once_the_slice_is_over() -> None:
    """The API server ran 0.5 ms at the start and slept; the engine has run since. At
    10 ms (the engine's slice long over) the API server is behind: it preempts at once."""
    env = simpy.Environment()
    core = FairCore(env, 4 * MS, slice_s=1.5 * MS)
    ends = _ends(core, [(0.0, 0.5 * MS, "api"), (0.5 * MS, 30 * MS, "engine"),
                        (10 * MS, 0.5 * MS, "api")])
    assert ends[2] == pytest.approx(10.5 * MS)
    assert ends[1] == pytest.approx(31 * MS)
    assert core.preemptions == 1


def test_a_process_that_used_more_than_its_share_waits_for_a_tick() -> None:
    """Beside a CPU-bound spinner, a process that keeps more than half the core is ahead
    of it when it wakes: it waits for the tick, where the spinner's slice is over and
    the one further behind runs."""
    env = simpy.Environment()
    core = FairCore(env, 4 * MS, slice_s=1.5 * MS)
    core.spin(1.0, process="spinner")
    ends = [0.0]

    def heavy():  # type: ignore[no-untyped-def]
        for _ in range(10):  # 3 ms of work a wake-up, 1 ms asleep
            due = env.now
            yield core.run(3 * MS, process="heavy")
            ends.append(env.now - due)
            yield env.timeout(1 * MS)

    env.process(heavy())
    env.run(until=1.0)
    assert max(ends) > 3 * MS + 1 * MS  # it waited at least a tick's worth somewhere
    assert len(ends) == 11


def test_a_spinner_of_demand_d_leaves_the_rest_of_each_tick() -> None:
    """A spinner of 0.25 beside 30 ms of work on one core: the work gets at least 3/4."""
    env = simpy.Environment()
    core = FairCore(env, 4 * MS)
    h = core.spin(0.25, process="spin")
    done = core.run(30 * MS, process="work")
    env.run(until=done)
    assert env.now <= 30 * MS / 0.75 + 4 * MS
    core.unspin(h)
    core.unspin(h)  # a second time: nothing
    env.run(until=env.now + 10 * MS)
    assert core.runnable == 0


def test_a_stopped_spinner_gives_the_core_back_at_once() -> None:
    env = simpy.Environment()
    core = FairCore(env, 4 * MS)
    h = core.spin(1.0, process="spin")
    done = core.run(10 * MS, process="work")
    env.run(until=2 * MS)
    core.unspin(h)
    env.run(until=done)
    assert env.now <= 2 * MS + 10 * MS + 1e-12
    assert core.busy_s == pytest.approx(env.now)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.02), st.floats(1e-5, 0.01),
                          st.sampled_from(["a", "b", "c", None])), min_size=1, max_size=12),
       st.sampled_from([1 * MS, 4 * MS]), st.sampled_from([0.75 * MS, 1.5 * MS, 4 * MS]))
def test_every_piece_is_served_exactly_and_the_core_never_idles_with_work(
        jobs: list[tuple[float, float, str | None]], tick: float, slc: float) -> None:
    """Work-conserving: the core serves exactly the work given, no piece ends before its
    start plus its work, and with every piece there from 0 the last ends at the sum."""
    ends = _ends(FairCore(simpy.Environment(), tick, slice_s=slc), jobs)
    for (at, work, _), end in zip(jobs, ends, strict=True):
        assert end >= at + work - 1e-9
    together = [(0.0, w, p) for _, w, p in jobs]
    ends = _ends(FairCore(simpy.Environment(), tick, slice_s=slc), together)
    assert max(ends) == pytest.approx(sum(w for _, w, _ in jobs))


def test_a_process_moving_cores_keeps_its_distance_from_the_floor() -> None:
    """Pinned cores by ticks share one memory of where each process left. The API
    server ran 10 ms alone on core 0 (its virtual runtime 10 ms, the floor's); on core 1
    an engine has run 20 ms since. Placed at its old virtual runtime the API server
    would be 10 ms behind and preempt at once; at its distance from the floor (0) it
    ties with the engine and waits for the tick."""
    env = simpy.Environment()
    pool = PinnedCores(env, 2, np.random.default_rng(0), tick_s=4 * MS)
    assert all(isinstance(p, FairCore) for p in pool.pools)
    env.run(until=pool.run(10 * MS, 0, process="api"))
    core1 = pool.pools[1]
    core1.spin(1.0, process="engine")  # core 1's floor starts here
    env.run(until=env.now + 20 * MS)
    assert isinstance(core1, FairCore)
    start = env.now
    done = pool.run(1 * MS, 1, process="api")
    env.run(until=done)
    assert env.now - start > 1 * MS  # not behind the engine: it waited for a tick
    assert core1.preemptions == 0


def test_the_base_slice_is_the_kernels() -> None:
    assert base_slice_s(1) == pytest.approx(0.75 * MS)
    assert base_slice_s(2) == pytest.approx(1.5 * MS)
    assert base_slice_s(4) == pytest.approx(2.25 * MS)
    assert base_slice_s(64) == pytest.approx(3.0 * MS)  # scaled as 8 CPUs at most
    with pytest.raises(ValueError, match="at least one CPU"):
        base_slice_s(0)


def test_bad_ticks_slices_and_work_are_refused() -> None:
    env = simpy.Environment()
    for bad in (0.0, -1.0, 2.0, math.nan):
        with pytest.raises(ValueError, match="a tick must be in"):
            FairCore(env, bad)
    with pytest.raises(ValueError, match="a slice must be in"):
        FairCore(env, 4 * MS, slice_s=0.0)
    core = FairCore(env, 4 * MS)
    with pytest.raises(ValueError, match="work must be >= 0"):
        core.run(-1.0)
    with pytest.raises(ValueError, match="demand must be in"):
        core.spin(1.5)
    assert core.runnable == 0


@pytest.mark.parametrize(("host", "match"), [
    ({"model": "shared-cpu", "cores": 2, "tick_s": 0.004}, r"host\.tick_s needs host\.pinned"),
    ({"model": "shared-cpu", "cores": 2, "pinned": True, "tick_s": -0.001},
     r"host\.tick_s must be in \[0, 1\.0\]"),
    ({"model": "shared-cpu", "cores": 2, "pinned": True, "tick_s": 2.0},
     r"host\.tick_s must be in \[0, 1\.0\]"),
    ({"tick_s": 0.004}, r"host\.\w+ is a key of the shared-cpu host model"),
])
def test_a_tick_needs_pinned_cores_and_a_sane_length(host: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ProfileError, match=match):
        profile_from_dict({"host": host})


def test_a_loaded_run_by_ticks_is_deterministic_and_not_processor_sharing() -> None:
    kw = {"frontend_cores": 1, "cores": 2, "pinned": True}
    a = tiny_result("push", 100.0, 16, tick_s=0.004, **kw)
    b = tiny_result("push", 100.0, 16, tick_s=0.004, **kw)
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]
    assert a["completed"] == 16
    fluid = tiny_result("push", 100.0, 16, **kw)
    assert a["ttfts"] != fluid["ttfts"]
