"""How the kernel shares one core (:mod:`pushkv.fit.sched`): the measurements run here,
on whatever core this process may use, and say what they saw."""

from __future__ import annotations

import os

import pytest

from pushkv.fit.sched import SchedError, tick, wake_waits

CORE = min(os.sched_getaffinity(0))


def test_two_spinners_on_one_core_take_turns() -> None:
    """Some turn was seen, and a turn is shorter than the measurement."""
    got = tick(CORE, seconds=0.5)
    assert 0 < got < 0.5


def test_a_sleeper_beside_a_spinner_is_late_and_done_after_its_work() -> None:
    work = 0.2e-3
    got = wake_waits(1, work, core=CORE, seconds=0.3)
    assert got
    for late, done in got:
        assert 0 <= late <= done
        assert done >= work


def test_a_core_this_process_may_not_use_is_refused() -> None:
    bad = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SchedError, match=f"core {bad} is not one"):
        tick(bad)
    with pytest.raises(SchedError, match=f"core {bad} is not one"):
        wake_waits(1, 1e-3, core=bad)
    with pytest.raises(SchedError, match="spinners must be >= 0"):
        wake_waits(-1, 1e-3, core=CORE)
