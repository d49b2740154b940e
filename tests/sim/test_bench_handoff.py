"""bench_handoff_waits' accounting (:mod:`pushkv.fit.handoff`), on hand-written samples:
which part's threads ran or waited on a run queue during a hand-off; its command line's
refusals; the ``/proc`` reader it samples with (:class:`pushkv.hostprobe.ThreadReader`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pushkv.fit.handoff import api_wait_share, bracket, by_part, handoffs, stats_ms
from pushkv.hostprobe import ThreadReader

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"1": ("decode_api", "python"), "2": ("decode", "VLLM::Worker"),
         "3": ("router", "python")}
MS = 1_000_000  # ns


def _samples() -> list[Any]:
    """Every 10 ms: the API server waits 8 ms a sample from 20 ms on, the worker runs
    throughout, the router does nothing."""
    out = []
    for k in range(8):
        api_wait = max(0, k - 2) * 8 * MS
        out.append((k * 0.010, {"1": (k * MS, api_wait, k), "2": (k * 10 * MS, 0, k),
                                "3": (5 * MS, 0, 1)}))
    return out


def test_by_part_brackets_the_interval_with_samples() -> None:
    got = by_part(_samples(), NAMES, 0.025, 0.041)  # samples at 20 ms and 50 ms
    assert got["decode"] == pytest.approx((0.030, 0.0))
    assert got["decode_api"] == pytest.approx((0.003, 0.024))
    assert "router" not in got  # it did nothing
    # a thread with no name (seen in no sample's listing) is skipped; no samples: nothing
    assert by_part(_samples(), {"2": NAMES["2"]}, 0.0, 0.07) == {
        "decode": pytest.approx((0.070, 0.0))}
    assert by_part([], NAMES, 0.0, 1.0) == {}


def test_the_api_servers_share_of_slow_hand_offs() -> None:
    """Two hand-offs: 20-40 ms (samples at 20 and 40 ms: 16 ms waited of 20) and 0-10
    ms (none waited): 16 of 30 ms."""
    share = api_wait_share([(0.020, 0.040), (0.000, 0.010)], _samples(), NAMES)
    assert share == pytest.approx(16 / 30)
    assert api_wait_share([], _samples(), NAMES) == 0.0


def test_the_share_is_over_the_samples_around_a_hand_off() -> None:
    """A 1 ms hand-off between samples 10 ms apart: the wait over those 10 ms (8 ms),
    not over the hand-off alone, which would read as 800%."""
    share = api_wait_share([(0.031, 0.032)], _samples(), NAMES)  # bracket 30-40 ms
    assert share == pytest.approx(0.8)
    assert bracket(_samples(), 0.031, 0.032) == (3, 4)
    assert bracket(_samples(), -1.0, 9.0) == (0, 7)  # outside: the nearest samples
    assert api_wait_share([(0.0, 0.01)], [], NAMES) == 0.0


def test_hand_offs_are_matched_to_the_requests_sent() -> None:
    requests = {"a": {"legs_sent": 1.0, "decode_arrived": 1.004},
                "b": {"legs_sent": 2.0, "decode_arrived": 2.030},
                "c": {"legs_sent": 2.1},  # no arrival: not a hand-off
                "d": {"legs_sent": 3.0, "decode_arrived": 3.01},
                "e": {"legs_sent": 3.1, "decode_arrived": 3.11}}
    sent = [("alone", 0.99, 1.01), ("beside", 1.99, 2.2), ("beside", 2.99, 3.2),
            ("beside", 5.0, 6.0)]
    assert handoffs(requests, sent) == {"alone": [(1.0, 1.004)], "beside": [(2.0, 2.030)]}


def test_stats_in_ms() -> None:
    got = stats_ms([0.001 * i for i in range(1, 11)])
    assert got == {"n": 10, "mean": 5.5, "median": 5.5, "p90": 10.0, "max": 10.0}
    assert stats_ms([]) == {"n": 0}


def test_bad_arguments_are_refused() -> None:
    """The command line, run as it is run: a bad argument ends it at once, with status 2
    and a line saying why."""
    got = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_handoff_waits.py"),
                          "--alone", "0"], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "--alone and --streams must be >= 1" in got.stderr


def test_the_reader_sees_this_process_threads() -> None:
    """A real /proc read: this process's threads, named, their run time growing; a pid
    that is gone reads as nothing."""
    import os

    reader = ThreadReader({"me": [os.getpid()], "gone": [2 ** 22 + 1]})
    first = reader()
    x = sum(i * i for i in range(200_000))  # some CPU time of this thread
    second = reader()
    me = str(os.getpid())  # the main thread's id is the pid
    assert x > 0 and me in first and reader.names[me][0] == "me"
    assert second[me][0] > first[me][0]
    assert all(part == "me" for part, _ in reader.names.values())
