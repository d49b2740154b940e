"""pushkv.timeline: marks recorded per process, joined by transfer id, summarised."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from pushkv import timeline


@pytest.fixture(autouse=True)
def _off():
    yield
    timeline.configure(None)


def test_off_records_nothing(tmp_path: Path):
    timeline.configure(None)
    assert not timeline.enabled()
    timeline.mark("t1", "legs_sent")
    assert timeline.read(tmp_path) == []


def test_marks_of_several_processes_join_by_transfer_id(tmp_path: Path):
    timeline.configure(tmp_path, "proxy")
    timeline.mark("t1", "legs_sent", 10.0)
    timeline.mark("t1", "first_token", 10.050)
    timeline.mark("t1", "first_token", 10.090)  # a repeated mark keeps its first time
    timeline.mark("t2", "legs_sent", 20.0)
    # Another process (the decode server) wrote its own file, and was killed mid-line.
    (tmp_path / "timeline-999999.jsonl").write_text(
        json.dumps({"id": "t1", "ev": "decode_seen", "t": 10.004, "p": "decode"}) + "\n"
        + json.dumps({"id": "t2", "ev": "decode_seen", "t": 20.010, "p": "decode"}) + "\n"
        + '{"id": "t2", "ev": "rea')
    requests = timeline.by_request(timeline.read(tmp_path))
    assert requests == {"t1": {"legs_sent": 10.0, "decode_seen": 10.004, "first_token": 10.05},
                        "t2": {"legs_sent": 20.0, "decode_seen": 20.010}}
    segs = timeline.segments(requests)
    assert segs["legs out -> decode sees"] == pytest.approx([4.0, 10.0])
    assert segs["legs out -> first token"] == pytest.approx([50.0])
    assert "write posted -> completed" not in segs  # no request recorded both ends


def test_report_gives_median_and_p90_per_mode(tmp_path: Path):
    for mode, step in (("push", 0.001), ("vllm-push", 0.003)):
        d = tmp_path / mode
        d.mkdir()
        lines = []
        for i in range(11):
            t0 = float(i)
            lines.append({"id": f"{mode}{i}", "ev": "legs_sent", "t": t0})
            lines.append({"id": f"{mode}{i}", "ev": "first_token", "t": t0 + step * (i + 1)})
        (d / "timeline-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    stats = timeline.summary({"push": tmp_path / "push", "vllm-push": tmp_path / "vllm-push"})
    seg = "legs out -> first token"
    assert stats["push"][seg] == {"median": 6.0, "p90": 10.0, "n": 11}
    assert stats["vllm-push"][seg]["median"] == pytest.approx(18.0)
    table = timeline.table(stats)
    assert "| legs out -> first token | 6.0 / 10.0 | 18.0 / 30.0 |" in table
    assert timeline.main([f"push={tmp_path / 'push'}", "--json"]) == 0


def test_every_segment_names_known_events():
    known = set(timeline.EVENTS)
    for _, start, end in timeline.SEGMENTS:
        assert {start, end} <= known
        assert timeline.EVENTS.index(start) < timeline.EVENTS.index(end)


def test_intake_segments_follow_a_leg_from_its_api_server_to_its_scheduler():
    assert not set(timeline.INTAKE) & set(timeline.EVENTS)
    for side in ("prefill", "decode"):
        chain = [f"{side}_{e}" for e in ("arrived", "sent", "queued", "taken", "seen")]
        got = [(a, b) for _, a, b in timeline.INTAKE_SEGMENTS if a.startswith(side)]
        assert got == list(itertools.pairwise(chain))
    named = {e for _, a, b in timeline.INTAKE_SEGMENTS for e in (a, b)}
    assert set(timeline.INTAKE) <= named <= set(timeline.INTAKE) | set(timeline.EVENTS)
    assert timeline.REPORT == timeline.SEGMENTS + timeline.INTAKE_SEGMENTS
    names = [n for n, _, _ in timeline.REPORT]
    assert len(set(names)) == len(names)


def test_the_report_gives_a_legs_intake_where_it_was_marked(tmp_path: Path):
    timeline.configure(tmp_path, "server")
    for i, ev in enumerate(("decode_arrived", "decode_sent", "decode_queued", "decode_taken",
                            "decode_seen")):
        timeline.mark("t1", ev, 10.0 + i * 0.002)
    stats = timeline.summary({"push": tmp_path})["push"]
    assert stats["decode queued -> taken"] == {"median": 2.0, "p90": 2.0, "n": 1}
    assert "| decode sent -> queued | 2.0 / 2.0 |" in timeline.table({"push": stats})
    assert "prefill sent -> queued" not in stats


def test_spans_are_a_processs_work_apart_from_its_marks_and_pauses(tmp_path: Path):
    timeline.span("step", 1.0, 2.0)  # off: nothing
    timeline.configure(tmp_path, "engine")
    timeline.span("step", 10.0, 10.004)
    timeline.span("forward", 10.001, 10.003)
    timeline.mark("t1", "prefill_taken", 10.0)
    timeline.configure(None)
    (tmp_path / "timeline-7.jsonl").write_text(
        json.dumps({"pause": "gc0", "t0": 9.0, "t1": 9.1, "p": "x", "pid": 7}) + "\n"
        + '{"span": "step", "t0": 11.')  # torn by a kill
    assert timeline.read_spans(tmp_path) == [
        timeline.Pause("engine", "step", 10.0, 10.004, os.getpid()),
        timeline.Pause("engine", "forward", 10.001, 10.003, os.getpid())]
    assert [p.kind for p in timeline.read_pauses(tmp_path)] == ["gc0"]
    assert timeline.by_request(timeline.read(tmp_path)) == {"t1": {"prefill_taken": 10.0}}


def test_endings_are_not_marks_of_a_complete_request():
    assert not set(timeline.ENDINGS) & set(timeline.EVENTS)
    assert len(set(timeline.ENDINGS)) == len(timeline.ENDINGS)


def test_a_processs_garbage_collections_are_pauses_beside_its_marks(tmp_path: Path):
    import gc

    timeline.configure(tmp_path, "router")
    timeline.record_gc(min_s=0.0)
    timeline.record_gc(min_s=0.0)  # once per process: one callback
    assert gc.callbacks.count(timeline._on_gc) == 1
    timeline.mark("t1", "legs_sent", 10.0)
    gc.collect()
    timeline.configure(None)
    pauses = timeline.read_pauses(tmp_path)
    assert "gc2" in [p.kind for p in pauses]
    gc.collect()  # recording off: nothing more is written
    assert timeline.read_pauses(tmp_path) == pauses
    timeline.record_gc()  # the default threshold again, for the rest of this process
    assert all(p.process == "router" and p.pid == os.getpid() and p.t1 >= p.t0
               for p in pauses)
    # The marks read as before, the pauses left out.
    assert timeline.by_request(timeline.read(tmp_path)) == {"t1": {"legs_sent": 10.0}}


def test_a_torn_pause_line_of_a_killed_process_is_skipped(tmp_path: Path):
    (tmp_path / "timeline-5.jsonl").write_text(
        json.dumps({"pause": "gc2", "t0": 2.0, "t1": 2.1, "p": "decode", "pid": 5}) + "\n"
        + json.dumps({"pause": "gc0", "t0": 1.0, "t1": 1.001, "p": "decode"}) + "\n"
        + '{"pause": "gc2", "t0": 3.')
    assert timeline.read_pauses(tmp_path) == [
        timeline.Pause("decode", "gc0", 1.0, 1.001),
        timeline.Pause("decode", "gc2", 2.0, 2.1, pid=5)]
