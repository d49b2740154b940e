"""The auditor (python -m pushkv.audit): real runs' timelines pass -- the in-memory
transport under adversarial delivery and real NIXL across two processes -- and
each doctored timeline is caught by the rule it breaks; unreadable input exits 2."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pushkv import timeline
from pushkv.audit import AuditInputError, audit
from pushkv.audit.__main__ import main
from pushkv.audit.steps import _NEEDED
from pushkv.integrity import Injector, IntegrityConfig
from pushkv.protocol import Mode, uniform_ranks
from pushkv.protocol.check.invariants import RULES
from pushkv.protocol.packing import PackingConfig
from pushkv.transports import conformance
from pushkv.transports.inmemory import InMemoryCluster, pair


@pytest.fixture
def recording(tmp_path: Path):
    """Record this process's timeline into a fresh directory while the test runs."""
    timeline.configure(None)
    d = tmp_path / "timeline"
    timeline.configure(d, "test")
    try:
        yield d
    finally:
        timeline.configure(None)


def _run_inmemory(d: Path) -> None:
    """TP 2 -> TP 1 with digests on (one write corrupted in flight): a transfer
    READY, one preempted and reissued, one cancelled, one pipelined packed, one
    corrupted and one pulled (two reads, each checked), so every kind of step is
    recorded."""
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               seed=5, integrity=IntegrityConfig("on"),
               injector=Injector(kinds=("flip",), every=1, limit=1),
               packing=PackingConfig(mode="always", staging_bytes=1 << 20, pipeline_bytes=1024))
    (c,) = net.consumers.values()
    prods = list(net.producers.values())

    def finish(tid: str, src: list[int], n: int) -> None:
        for p in prods:
            p.apply(p.endpoint.prefill_finished(tid, src, n, net.now))

    c.apply(c.endpoint.register("bad", "P", [30], 16, net.now))  # the injector's one
    finish("bad", [9], 16)
    net.run()
    c.apply(c.endpoint.register("ok", "P", [1, 2], 20, net.now))
    finish("ok", [0, 1], 20)
    c.apply(c.endpoint.register("re", "P", [3, 4], 20, net.now))
    net.advance(0.0001)
    c.apply(c.endpoint.preempt("re", net.now))
    c.apply(c.endpoint.reissue("re", [5, 6], net.now))
    finish("re", [2, 3], 20)
    c.apply(c.endpoint.register("gone", "P", [7], 10, net.now))
    net.advance(0.0001)
    c.apply(c.endpoint.abort("gone", net.now))
    finish("gone", [4], 10)
    net.run()
    for p in prods:
        p.apply(p.endpoint.prefill_finished("pl", [5, 6], 20, net.now, mode=Mode.PULL))
    net.run()
    c.start_pull("pl", "P", [5, 6], [10, 11], 20,
                 seals={p.peer.rank: p.published["pl"].seal for p in prods})
    net.run()
    assert [c.outcome(t) for t in ("bad", "ok", "re", "gone", "pl")] == [
        "failed", "ready", "ready", "cancelled", "ready"], c.outcomes


def _lines(d: Path) -> list[dict[str, Any]]:
    (path,) = d.glob("timeline-*.jsonl")
    return [json.loads(x) for x in path.read_text().splitlines()]


def _write(d: Path, lines: list[dict[str, Any]]) -> None:
    (path,) = d.glob("timeline-*.jsonl")
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _steps(lines: list[dict[str, Any]], ev: str, tid: str | None = None) -> list[int]:
    return [i for i, x in enumerate(lines) if x.get("ev") == ev and "a" in x
            and (tid is None or x["id"] == tid)]


def test_a_real_inmemory_run_with_every_kind_of_step_is_clean(recording, capsys):
    _run_inmemory(recording)
    report = audit(recording)
    seen = {x["ev"] for x in _lines(recording) if "a" in x}
    assert seen == set(timeline.STEPS), seen
    assert report.clean, report.lines()
    assert main([str(recording)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": clean")


def test_every_step_the_timeline_records_is_one_the_auditor_reads():
    assert set(_NEEDED) == set(timeline.STEPS)


# --------------------------------------------------------------- doctored timelines


def _move_after(lines: list[dict[str, Any]], i: int, j: int) -> None:
    """Line ``i`` happens just after line ``j`` (same process: placed after it)."""
    x = lines.pop(i)
    j = j - (i < j)
    x["t"] = lines[j]["t"]
    lines.insert(j + 1, x)


def _post_after_release(lines):  # a write posted from a released source
    post = _steps(lines, "write_posted", "ok")[0]
    _move_after(lines, post, _steps(lines, "source_released", "ok")[-1])


def _post_after_lease(lines):
    post = _steps(lines, "write_posted", "ok")[0]
    a = lines[post]["a"]
    lease = {"id": "ok", "ev": "answer_sent", "t": lines[post]["t"], "p": "test",
             "a": {"inc": a["inc"], "att": a["att"] + 7, "src": a["src"], "dst": a["dst"],
                   "posted": 0, "failed": 0, "reason": "LEASE_EXPIRED"}}
    lines.insert(post, lease)


def _post_after_answer(lines):  # the reissued attempt answered (CancelAck), then written
    post = next(i for i in _steps(lines, "write_posted", "re") if lines[i]["a"]["att"] == 1)
    a = lines[post]["a"]
    lines.insert(post, {"id": "re", "ev": "answer_sent", "t": lines[post]["t"], "p": "test",
                        "a": {"inc": a["inc"], "att": 1, "src": a["src"], "dst": a["dst"],
                              "posted": 0, "failed": 0, "reason": ""}})


def _landed_after_release(lines):  # the preempted attempt's bytes land after its release
    release = next(i for i in _steps(lines, "dest_released", "re") if lines[i]["a"]["att"] == 0)
    note = dict(lines[_steps(lines, "notify_received", "re")[0]])
    note["a"] = dict(note["a"], att=0)
    note["t"] = lines[release]["t"]
    lines.insert(release + 1, note)


def _released_before_landing(lines):  # blocks back while a write into them is unlanded
    release = _steps(lines, "dest_released", "gone")[0]
    post = dict(lines[_steps(lines, "write_posted", "ok")[0]])
    post["id"] = "gone"
    post["a"] = dict(post["a"], att=lines[release]["a"]["att"],
                     inc=lines[release]["a"]["inc"])
    post["t"] = lines[release]["t"]
    lines.insert(release, post)


def _answer_miscounts(lines):
    i = _steps(lines, "answer_sent", "bad")[0]
    lines[i]["a"]["posted"] += 1


def _two_outcomes(lines):
    i = _steps(lines, "outcome", "ok")[0]
    lines.insert(i + 1, dict(lines[i], a=dict(lines[i]["a"], kind="failed")))


def _stale_outcome(lines):
    i = _steps(lines, "outcome", "re")[0]
    lines[i]["a"]["att"] = 0


def _ready_without_a_part(lines):
    i = _steps(lines, "notify_received", "ok")[-1]
    del lines[i]


def _ready_without_a_digest(lines):
    i = _steps(lines, "digest_checked", "ok")[0]
    del lines[i]


def _ready_after_a_bad_digest(lines):
    i = _steps(lines, "digest_checked", "ok")[0]
    lines[i]["a"]["ok"] = False


def _ready_before_its_last_landing(lines):
    i = _steps(lines, "outcome", "ok")[0]
    note = _steps(lines, "notify_received", "ok")[-1]
    _move_after(lines, note, i)


def _pull_ready_without_a_read(lines):
    del lines[_steps(lines, "read_completed", "pl")[-1]]


def _pull_ready_before_a_read_completed(lines):
    _move_after(lines, _steps(lines, "read_completed", "pl")[0],
                _steps(lines, "outcome", "pl")[0])


def _pull_ready_after_a_failed_read(lines):
    lines[_steps(lines, "read_completed", "pl")[0]]["a"]["ok"] = False


def _pull_ready_without_a_digest(lines):
    del lines[_steps(lines, "digest_checked", "pl")[-1]]


def _pull_ready_after_a_bad_digest(lines):
    lines[_steps(lines, "digest_checked", "pl")[0]]["a"]["ok"] = False


DOCTORED: dict[str, tuple[Callable[[list[dict[str, Any]]], None], str]] = {
    "post after source release": (_post_after_release, "source"),
    "post after lease end": (_post_after_lease, "lease"),
    "post after the attempt's answer": (_post_after_answer, "cancelled"),
    "landing after the blocks' release": (_landed_after_release, "reuse"),
    "release before a posted write landed": (_released_before_landing, "fence"),
    "answer miscounting the writes posted": (_answer_miscounts, "fence"),
    "two outcomes on one rank": (_two_outcomes, "outcome"),
    "outcome of an older attempt": (_stale_outcome, "stale"),
    "READY without a part's notification": (_ready_without_a_part, "bytes"),
    "READY without a sealed part's digest": (_ready_without_a_digest, "bytes"),
    "READY after a bad digest": (_ready_after_a_bad_digest, "bytes"),
    "READY before a write landed": (_ready_before_its_last_landing, "bytes"),
    "pull READY without a read's completion": (_pull_ready_without_a_read, "bytes"),
    "pull READY before a read completed": (_pull_ready_before_a_read_completed, "bytes"),
    "pull READY after a failed read": (_pull_ready_after_a_failed_read, "bytes"),
    "pull READY without a sealed read's digest": (_pull_ready_without_a_digest, "bytes"),
    "pull READY after a bad read digest": (_pull_ready_after_a_bad_digest, "bytes"),
}


@pytest.fixture(scope="module")
def real_lines(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    timeline.configure(None)
    d = tmp_path_factory.mktemp("real")
    timeline.configure(d, "test")
    try:
        _run_inmemory(d)
    finally:
        timeline.configure(None)
    return _lines(d)


@pytest.mark.parametrize("case", list(DOCTORED))
def test_a_doctored_timeline_is_caught_by_the_rule_it_breaks(case, real_lines, tmp_path,
                                                              capsys):
    doctor, rule = DOCTORED[case]
    lines = json.loads(json.dumps(real_lines))
    doctor(lines)
    d = tmp_path / "tl"
    d.mkdir()
    (d / "timeline-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = audit(d)
    assert rule in {f.rule for f in report.findings}, (case, report.lines())
    assert main([str(d)]) == 1
    out = capsys.readouterr().out.splitlines()
    hit = next(line for line in out if line.startswith(f"VIOLATION {rule}:"))
    assert "transfer " in hit and " rank " in hit and "@+" in hit and RULES[rule] in hit
    assert "violation(s)" in out[-1]
    assert main([str(d), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert not got["clean"] and got["by_rule"][rule] >= 1
    v = next(v for v in got["violations"] if v["rule"] == rule)
    assert v["events"] and all({"event", "t", "process"} <= set(e) for e in v["events"])


# ------------------------------------------------------------------ unreadable input


def _expect_unreadable(d: Path, words: str, capsys) -> None:
    with pytest.raises(AuditInputError, match=re.escape(words)):
        audit(d)
    assert main([str(d)]) == 2
    assert words in capsys.readouterr().err
    assert main([str(d), "--json"]) == 2
    assert words in json.loads(capsys.readouterr().out)["error"]


def test_unreadable_input_exits_2_and_says_why(real_lines, tmp_path, capsys):
    _expect_unreadable(tmp_path / "missing", "no such directory", capsys)
    _expect_unreadable(tmp_path, "no timeline-*.jsonl file", capsys)
    f = tmp_path / "timeline-1.jsonl"
    f.write_text('{"id": "r", "ev": "received", "t": 1.0, "p": "proxy"}\n')
    _expect_unreadable(tmp_path, "no protocol step", capsys)
    good = "".join(json.dumps(x) + "\n" for x in real_lines)
    f.write_text("{not json\n" + good)
    _expect_unreadable(tmp_path, "not a JSON line", capsys)
    step = next(x for x in real_lines if x.get("ev") == "write_posted")
    f.write_text(json.dumps(dict(step, a={k: v for k, v in step["a"].items() if k != "att"}))
                 + "\n")
    _expect_unreadable(tmp_path, "without its field 'att'", capsys)
    f.write_text(json.dumps(dict(step, a=dict(step["a"], part="0"))) + "\n")
    _expect_unreadable(tmp_path, "field 'part'", capsys)
    f.write_text(good + '{"id": "ok", "ev": "outc')  # a killed process's torn last line
    assert audit(tmp_path).clean


# ------------------------------------------------------------------ real runs


def test_inmemory_conformance_runs_are_clean(tmp_path):
    """Every push conformance check (faults, reissues, reused ids, progressive parts)
    under adversarial delivery, packed and pipelined writes too."""
    pipelined = PackingConfig(mode="always", staging_bytes=1 << 20, pipeline_bytes=512)
    for packing in (None, pipelined):
        for suite in (conformance.CHECKS, conformance.REUSED_ID_CHECKS,
                      conformance.PROGRESSIVE_CHECKS if packing is None else {}):
            for name, (fn, kwargs) in suite.items():
                d = tmp_path / f"{name}-{packing is not None}"
                timeline.configure(None)
                timeline.configure(d, "inmemory")
                try:
                    fn(functools.partial(InMemoryCluster, seed=1, packing=packing), **kwargs)
                finally:
                    timeline.configure(None)
                if d.exists() and any(d.glob("*.jsonl")):
                    report = audit(d)
                    assert report.clean, (name, report.lines())


@pytest.mark.nixl
def test_nixl_runs_across_two_processes_are_clean(tmp_path):
    pytest.importorskip("nixl._api", reason="the nixl package is not installed")
    pytest.importorskip("zmq", reason="pyzmq is not installed")
    from pushkv.transports.nixl import NixlConfig
    from pushkv.transports.nixl.testing import HostPool, NixlCluster

    pool = HostPool()
    checks = {**conformance.CHECKS, **conformance.PULL_CHECKS}
    try:
        for name in ("transfer_tp2-1", "reissue_after_kv", "cancel", "pull_transfer_tp2-1"):
            fn, kwargs = checks[name]
            d = tmp_path / name
            for role in ("producer", "consumer"):
                pool.get(role).call("timeline", str(d))
            # digests on: a pull's READY must follow each read's good digest check
            fn(lambda topo: NixlCluster(topo, pool, NixlConfig(integrity="on")), **kwargs)
            for role in ("producer", "consumer"):
                pool.get(role).call("timeline", None)
            report = audit(d)
            assert len(report.run.processes) == 2, report.run.processes
            assert report.clean, (name, report.lines())
            assert main([str(d)]) == 0
    finally:
        pool.close()
