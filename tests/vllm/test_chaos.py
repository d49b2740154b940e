"""Serving under faults on real vLLM CPU servers, behind ``pushkv proxy``.

A plain server gives the reference greedy outputs and stops; then four servers
with PushKVConnector run for the module (two prefill, two decode; default
side-channel settings, so each binds free ports of its own on this one host).
Two deployments are driven through a proxy of their own: 2 prefill +
1 decode, then 1 prefill + 2 decode. In each, concurrent clients (streamed and
not) run while

* an instance is killed (``SIGKILL`` of all its processes), then restarted and
  put back in rotation, and
* an instance is frozen (``SIGSTOP``: a hang, its sockets still open) until the
  proxy takes it out of rotation, then thawed.

Every request must equal the plain server's output or end with a clear HTTP
error (an OpenAI-style JSON error body, or an SSE error event); none may go
unanswered past the proxy's bound (plus a margin for a loaded machine); some
request must have been sent again as a new transfer. Afterwards every live
instance references no KV block (nothing held for a push, nothing lent to a
registration) and runs no more threads than it did idle after its warm-up, and
each failed transfer was logged as one line of JSON (as many lines as the
instance's ``pushkv:transfers_failed_total``).

A short soak follows: the code of ``benchmarks/bench_chaos.py``'s soak, with a few
dozen requests of mixed lengths, a tenth of them from clients that leave at a
random point; nothing may be left behind.

All waits poll state with generous deadlines. How many requests are served rather
than answered with an error depends on the machine's load; that some are does not.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.audit import audit
from pushkv.vllm.chaos import (
    FAILED_KEYS,
    FAST,
    STARTUP_S,
    Fleet,
    Job,
    Load,
    Outcome,
    prompt,
    references,
    soak,
    soak_jobs,
    wait_for,
    warm,
)
from pushkv.vllm.testing import get_text, metric

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

MAX_TOKENS = 12
BOUND_S = 30.0  #: the proxy's bound on a client's wait
PATIENCE_S = BOUND_S + 20  #: a client still waiting after this counts as hung
LENGTHS = (5, 31, 33, 64, 97, 150, 200, 17)
PHASE_JOBS = 24
CLIENTS = 6
SOAK_JOBS = 48
NAMES = ("prefill-1", "prefill-2", "decode-1", "decode-2")
_salts = itertools.count(1000)


class Refs:
    """Fresh prompts (no prefix cache hit) with the plain server's greedy outputs."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        self._pairs = pairs

    def pairs(self, n: int) -> list[tuple[list[int], list[int]]]:
        assert len(self._pairs) >= n, "the module needs more reference prompts"
        out, self._pairs = self._pairs[:n], self._pairs[n:]
        return out

    def jobs(self, n: int) -> list[Job]:
        return [Job(tokens, ref, stream=i % 3 == 0)
                for i, (tokens, ref) in enumerate(self.pairs(n))]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Fleet, Refs]]:
    f = Fleet(str(tiny_model), tmp_path_factory.mktemp("chaos-logs"))
    for name, cpu in zip(NAMES, (0, 1, 1, 0), strict=True):  # steps for the audit
        f.add(name, name.split("-")[0], cpu, timeline_dir=str(f.logs / "timeline"))
    plain = f.plain(cpu=0)
    try:
        plain.start()
        plain.wait_healthy(STARTUP_S)
        prompts = [prompt(LENGTHS[i % len(LENGTHS)], next(_salts)) for i in range(240)]
        outs = references(plain.url, f.model, prompts, MAX_TOKENS)
        plain.stop()  # before the fleet starts: at most four servers at once
        f.start(*NAMES)
        yield f, Refs(list(zip(prompts, outs, strict=True)))
    finally:
        plain.stop()
        f.stop()


def check(outcomes: list[Outcome], what: str) -> None:
    kinds = Load.summary(outcomes)
    bad = [o for o in outcomes if o.kind not in ("correct", "clear_error")]
    assert not bad, f"{what}: {kinds}; first: {bad[:3]}"
    assert max(o.latency_s for o in outcomes) < PATIENCE_S
    # How many are served depends on the machine's load; that some are, does not.
    assert kinds["correct"] >= 1, f"{what}: nothing served: {kinds}"


def warm_round(f: Fleet, url: str, refs: Refs) -> dict[str, int]:
    """Handshake every pair (one request at a time: ties go in turn), serve a round
    of concurrent requests, wait until idle; each live instance's threads then."""
    warm(url, f.model, refs.jobs(4))
    check(Load(url, f.model, refs.jobs(CLIENTS * 2), clients=CLIENTS,
               timeout_s=PATIENCE_S).start().join(PATIENCE_S * 4), "warm-up")
    f.wait_idle()
    return f.all_threads()


def run_phase(f: Fleet, url: str, refs: Refs, fault: Callable[[], None], what: str
              ) -> list[Outcome]:
    """Concurrent clients; ``fault`` once the first answers are back."""
    load = Load(url, f.model, refs.jobs(PHASE_JOBS), clients=CLIENTS,
                timeout_s=PATIENCE_S).start()
    wait_for(lambda: load.done >= CLIENTS, 240, f"{what}: first answers")
    fault()
    outcomes = load.join(PATIENCE_S * PHASE_JOBS)
    print(f"{what}: {dict(Load.summary(outcomes))}")  # shown with -s or on failure
    check(outcomes, what)
    return outcomes


def freezer(f: Fleet, url: str, name: str) -> Callable[[], None]:
    """SIGSTOP ``name``; thaw it once the proxy has taken it out of rotation."""
    def fault() -> None:
        f.freeze(name)
        try:
            wait_for(lambda: not f.in_rotation(url, name), 60, f"{name} out of rotation")
        finally:
            f.thaw(name)
    return fault


def kill_restart_freeze(f: Fleet, refs: Refs, prefill: list[str], decode: list[str],
                        victim: str, frozen: str) -> None:
    url = f.proxy(prefill, decode, timeout_s=BOUND_S)
    idle = warm_round(f, url, refs)
    run_phase(f, url, refs, lambda: f.kill(victim), f"{victim} killed")
    f.restart(victim)
    wait_for(lambda: f.in_rotation(url, victim), 120, f"{victim} back in rotation")
    idle[victim] = warm_round(f, url, refs)[victim]  # the new process's own idle value
    run_phase(f, url, refs, freezer(f, url, frozen), f"{frozen} frozen")
    # Some request was sent again as a new transfer: the faults hit requests in flight.
    assert metric(get_text(url + "/metrics"), "pushkv_proxy_retries_total") >= 1
    blocks = f.wait_idle()  # raises unless every live instance holds/lends nothing
    assert set(blocks) == set(NAMES) and not any(blocks.values()), blocks
    threads = f.wait_threads(idle)
    print(f"retries {metric(get_text(url + '/metrics'), 'pushkv_proxy_retries_total')}, "
          f"blocks {blocks}, threads idle {idle}, after {threads}")
    check_failure_lines(f)
    f.close_proxy(url)


def check_failure_lines(f: Fleet) -> None:
    """Each failed transfer logged one line of JSON with every key, on its instance."""
    for name in [i.name for i in f.live()]:
        def logged(n: str = name) -> bool:
            return len(f.failure_lines(n)) == f.counter(n, "pushkv:transfers_failed_total")
        wait_for(logged, 60, lambda n=name: f"{n}: {len(f.failure_lines(n))} lines, "
                 f"{f.counter(n, 'pushkv:transfers_failed_total')} failed transfers")
        for record in f.failure_lines(name):
            assert record.keys() >= FAILED_KEYS, record


def test_two_prefill_one_decode_survive_kill_restart_and_freeze(fleet):
    f, refs = fleet
    kill_restart_freeze(f, refs, ["prefill-1", "prefill-2"], ["decode-1"],
                        victim="prefill-2", frozen="prefill-1")


def test_one_prefill_two_decode_survive_kill_restart_and_freeze(fleet):
    f, refs = fleet
    kill_restart_freeze(f, refs, ["prefill-1"], ["decode-1", "decode-2"],
                        victim="decode-2", frozen="decode-1")


def test_short_soak_with_clients_leaving_leaves_nothing_behind(fleet):
    f, refs = fleet
    url = f.proxy(["prefill-1", "prefill-2"], ["decode-1", "decode-2"], timeout_s=BOUND_S)
    warm(url, f.model, refs.jobs(4))
    f.wait_idle()
    jobs = soak_jobs(refs.pairs(SOAK_JOBS), random.Random(7))
    report = soak(f, url, f.model, jobs, clients=CLIENTS, timeout_s=PATIENCE_S, windows=2)
    kinds = Load.summary(report.outcomes)
    print(report.figures())
    assert len(report.outcomes) == SOAK_JOBS and not report.bad, (kinds, report.bad[:3])
    assert kinds["left"] >= 1, kinds  # the streamed leavers leave before [DONE]
    assert report.leaked_blocks == 0, report.blocks_end
    assert all(report.threads_end[k] <= v for k, v in report.threads_idle.items()), (
        report.threads_idle, report.threads_end)
    f.close_proxy(url)


def test_every_transfer_of_the_chaos_passes_the_audit(fleet):
    """After the kills, restarts, freezes and the soak: the protocol steps every
    instance recorded break no promise (python -m pushkv.audit)."""
    f, _ = fleet
    f.wait_idle()
    report = audit(f.logs / "timeline", grace_s=FAST["fence_grace_s"])
    assert report.run.uses, report.summary()
    assert report.clean, "\n".join(report.lines())


def test_a_process_cpu_time_grows_while_it_works_and_is_nan_once_it_is_gone():
    import math
    import os
    import subprocess
    import sys
    import time

    from pushkv.hostprobe import process_cpu_s

    start = process_cpu_s(os.getpid())
    deadline = time.monotonic() + 60
    while process_cpu_s(os.getpid()) <= start:  # a tick (1/CLK_TCK s) of work at most
        assert time.monotonic() < deadline
        sum(range(10_000))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert math.isnan(process_cpu_s(gone.pid))


def test_run_queue_wait_grows_for_processes_that_share_a_core_and_is_nan_once_gone():
    """Three spinning processes pinned to one core wait on its run queue for each
    other: their wait (per process, and summed over their process group) grows."""
    import math
    import os
    import subprocess
    import sys

    from pushkv.hostprobe import group_runq_wait_s, runq_wait_s
    from pushkv.vllm.testing import poll

    core = min(os.sched_getaffinity(0))
    spin = (f"import os, time; os.sched_setaffinity(0, {{{core}}}); "
            "end = time.monotonic() + 120\nwhile time.monotonic() < end: pass")
    leader = subprocess.Popen([sys.executable, "-c", spin], process_group=0)
    others = [subprocess.Popen([sys.executable, "-c", spin], process_group=leader.pid)
              for _ in range(2)]
    try:
        start, group_start = runq_wait_s(leader.pid), group_runq_wait_s([leader.pid])
        waited = poll(lambda: (runq_wait_s(leader.pid), group_runq_wait_s([leader.pid])),
                      lambda w: w[0] > start + 0.05 and w[1] > group_start + 0.1,
                      timeout_s=60, interval_s=0.05)
        assert waited[0] > start + 0.05 and waited[1] > group_start + 0.1, waited
    finally:
        for p in (leader, *others):
            p.kill()
            p.wait()
    assert math.isnan(runq_wait_s(leader.pid))
    assert group_runq_wait_s([leader.pid]) == 0.0


def test_thread_sched_splits_pinned_from_floating_threads_and_sums_over_a_group():
    """A process pinned to one core counts as pinned, one free to use every core as
    floating; a group sums both; the arithmetic is componentwise; a process that is
    gone gives None."""
    import os
    import subprocess
    import sys

    from pushkv.hostprobe import Sched, ThreadSched, group_thread_sched, thread_sched
    from pushkv.vllm.testing import poll

    assert Sched(1.0, 2.0, 3) + Sched(0.5, 0.5, 1) - Sched(0.5, 1.0, 2) == Sched(1.0, 1.5, 2)
    assert (ThreadSched(Sched(1.0), Sched(0.0, 1.0)) - ThreadSched(Sched(0.5))
            == ThreadSched(Sched(0.5), Sched(0.0, 1.0)))
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("on one core every thread is pinned")
    spin = "end = time.monotonic() + 120\nwhile time.monotonic() < end: pass"
    pin = f"import os, time; os.sched_setaffinity(0, {{{min(cores)}}})\n{spin}"
    leader = subprocess.Popen([sys.executable, "-c", pin], process_group=0)
    free = subprocess.Popen([sys.executable, "-c", f"import time\n{spin}"],
                            process_group=leader.pid)
    try:
        got = poll(lambda: (thread_sched(leader.pid), thread_sched(free.pid),
                            group_thread_sched([leader.pid])),
                   lambda g: (g[0] is not None and g[0].pinned.run_s > 0.1
                              and g[1] is not None and g[1].floating.run_s > 0.1
                              and g[2].pinned.run_s > 0.1 and g[2].floating.run_s > 0.1),
                   timeout_s=60, interval_s=0.05)
        pinned, floating, group = got
        assert pinned is not None and pinned.pinned.slices > 0
        assert floating is not None and floating.floating.slices > 0
        assert pinned.floating == Sched() and floating.pinned == Sched()
        assert group.pinned.run_s >= pinned.pinned.run_s
    finally:
        for p in (leader, free):
            p.kill()
            p.wait()
    assert thread_sched(leader.pid) is None
    assert group_thread_sched([leader.pid]) == ThreadSched()


def test_group_pids_lists_the_processes_of_a_group_while_they_live():
    import subprocess
    import sys

    from pushkv.hostprobe import group_pids

    wait = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    leader = subprocess.Popen(wait, stdin=subprocess.PIPE, process_group=0)
    member = subprocess.Popen(wait, stdin=subprocess.PIPE, process_group=leader.pid)
    try:
        assert group_pids([leader.pid]) == sorted([leader.pid, member.pid])
    finally:
        for p in (leader, member):
            p.kill()
            p.wait()
            p.stdin.close()  # type: ignore[union-attr]
    assert group_pids([leader.pid]) == []
