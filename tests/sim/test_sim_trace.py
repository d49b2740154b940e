"""Trace replay: the reader on the shipped Mooncake slice, its refusals, the prefix
cache against a brute-force count of an LRU, and a run's hits as the hashes imply."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.sim import SimConfig, TransferMode, run
from pushkv.sim.cli import main
from pushkv.sim.runner import prefix_cache_blocks
from pushkv.sim.trace import (
    PrefixCache,
    TraceError,
    cached_tokens,
    parse_lines,
    read_trace,
    shipped_slice,
    trace_workload,
)

SLICE = shipped_slice()
RAW = [json.loads(line) for line in SLICE.read_text().splitlines()]


def test_the_slice_ships_with_its_licence_and_source() -> None:
    assert (SLICE.parent / "LICENSE-APACHE-2.0").read_text().startswith(
        "\n                                 Apache License")
    assert "github.com/kvcache-ai/Mooncake" in (SLICE.parent / "README.md").read_text()
    assert 200 <= len(RAW) <= 1000


def test_the_reader_gives_the_slice_as_it_is() -> None:
    t = read_trace(SLICE)
    assert len(t.requests) == len(RAW)
    for i, (r, d) in enumerate(zip(t.requests, RAW, strict=True)):
        assert r.index == i
        assert r.arrival == d["timestamp"] / 1000
        assert (r.input_len, r.output_len) == (d["input_length"], d["output_length"])
        assert list(r.block_hashes) == d["hash_ids"]
    assert t.has_hashes and t.span_s == RAW[-1]["timestamp"] / 1000


def test_speed_and_window_scale_and_cut() -> None:
    t = read_trace(SLICE, speed=2.0, window=(10.0, 40.0))
    kept = [d for d in RAW if 10_000 <= d["timestamp"] < 40_000]
    assert [r.input_len for r in t.requests] == [d["input_length"] for d in kept]
    assert [r.arrival for r in t.requests] == [(d["timestamp"] / 1000 - 10) / 2 for d in kept]
    with pytest.raises(TraceError, match=r"no request in the window \[1000, 2000\)"):
        read_trace(SLICE, window=(1000, 2000))


def test_the_pushkv_format_and_no_hashes() -> None:
    t = parse_lines(['{"arrival_s": 0.5, "input_len": 600, "output_len": 3, '
                     '"block_hashes": [4, 9]}', "", '{"arrival_s": 1.5, "input_len": 7, '
                     '"output_len": 1}'])
    assert [(r.arrival, r.input_len, r.block_hashes) for r in t.requests] == [
        (0.5, 600, (4, 9)), (1.5, 7, ())]


@pytest.mark.parametrize(("line", "words"), [
    ("not json", "not JSON"),
    ("[1, 2]", "a JSON object"),
    ('{"input_length": 5, "output_length": 1}', "no arrival time"),
    ('{"timestamp": 5, "output_length": 1}', "input_length is missing"),
    ('{"timestamp": 5, "input_length": 5, "output_length": 1, "text": "hi"}',
     "unknown key(s) text"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "a time >= 0"),
    ('{"timestamp": 5, "input_length": 5.5, "output_length": 1}', "must be an integer"),
    ('{"timestamp": 5, "input_length": 5, "output_length": 0}', "output_length must be >= 1"),
    ('{"timestamp": 5, "input_length": 513, "output_length": 1, "hash_ids": [1]}',
     "1 block hashes for 513 tokens (2 blocks of 512)"),
    ('{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
     r"hash_ids\[0\] must be an integer"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "before the previous"),
])
def test_a_bad_line_is_refused_with_its_number(tmp_path: Path, line: str, words: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 2, "input_length": 5, "output_length": 1}\n\n'
                    + line + "\n")
    with pytest.raises(TraceError, match=r"^t\.jsonl:3: .*" + (
            words if "\\" in words else re.escape(words))):
        read_trace(path)


def _brute_force_hits(hash_lists: list[tuple[int, ...]], capacity: int) -> list[int]:
    """Leading cached blocks of each prompt, from the definition of an LRU cache of
    ``capacity`` blocks: it holds the ``capacity`` most recently touched distinct
    blocks; a prompt touches its blocks last to first."""
    last: dict[int, int] = {}
    clock = 0
    hits = []
    for hashes in hash_lists:
        held = set(sorted(last, key=last.__getitem__)[-capacity:])
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        hits.append(n)
        for h in reversed(hashes):
            clock += 1
            last[h] = clock
    return hits


@pytest.mark.parametrize("capacity", [1, 40, 400, 10**6])
def test_the_prefix_cache_is_an_lru_of_blocks(capacity: int) -> None:
    lists = [tuple(d["hash_ids"]) for d in RAW]
    cache = PrefixCache(capacity)
    got = [cache.admit(h) for h in lists]
    assert got == _brute_force_hits(lists, capacity)
    assert len(cache) == min(capacity, len({h for hs in lists for h in hs}))
    if capacity == 10**6:  # unbounded: a block is a hit iff seen before (as a prefix)
        assert sum(got) > 0


def test_a_run_hits_exactly_what_the_hashes_imply() -> None:
    trace = read_trace(SLICE, window=(0.0, 30.0))
    cfg = SimConfig(mode=TransferMode.PUSH, trace=trace, workload=trace_workload(trace))
    # a small prefill KV memory, so that the LRU evicts within the slice
    small = dataclasses.replace(cfg.profile, prefill=dataclasses.replace(
        cfg.profile.prefill, gpu_memory_utilization=0.15))
    for profile in (cfg.profile, small):
        c = dataclasses.replace(cfg, profile=profile)
        cap = prefix_cache_blocks(profile)
        lists = [r.block_hashes for r in trace.requests]
        hits = _brute_force_hits(lists, cap)
        bs = profile.prefill.block_size
        want = sum(cached_tokens(h, r.input_len, bs) for h, r in zip(hits, trace.requests,
                                                                      strict=True))
        extra = run(c).result["pushkv"]
        assert extra["prefill_cached_tokens"] == want
        assert extra["prefix_hit_blocks"] == sum(hits)
        prompt = sum(r.input_len for r in trace.requests)
        assert extra["prefix_hit_rate"] == pytest.approx(want / prompt)
        assert extra["leaked_blocks"] == 0 and extra["prefix_cache_blocks"] == cap
    assert cap < len({h for hs in lists for h in hs})  # the small memory did evict


def test_progress_reports_and_changes_nothing() -> None:
    trace = read_trace(SLICE, window=(0.0, 20.0))
    cfg = SimConfig(mode=TransferMode.PULL, trace=trace, workload=trace_workload(trace))
    seen: list[tuple[float, int, int]] = []
    a = run(cfg, progress=lambda *x: seen.append(x), progress_every_s=2.0)
    b = run(cfg)
    assert json.dumps(a.result) == json.dumps(b.result)
    assert seen and all(total == len(trace.requests) for _, _, total in seen)
    assert [n for _, n, _ in seen] == sorted(n for _, n, _ in seen)


def test_the_cli_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(SLICE), "--trace-window", "0", "15",
                 "--trace-speed", "2", "--mode", "pull", "--result-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trace mooncake_conversation_head" in out or "trace mooncake-conversation" in out
    [f] = tmp_path.iterdir()
    assert f.name == "pull_trace-mooncake_conversation_head_iter0.json"
    extra = json.loads(f.read_text())["pushkv"]
    assert extra["trace_speed"] == 2.0 and extra["trace_window_s"] == [0.0, 15.0]


@pytest.mark.parametrize(("argv", "words"), [
    (["--trace-speed", "2"], "--trace-speed needs --trace FILE"),
    (["--trace", str(SLICE), "--prefix-hit", "0.5"], "exclude each other"),
    (["--trace", "/nonexistent/t.jsonl"], "trace file not found"),
])
def test_trace_flags_refused(argv: list[str], words: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sim", *argv])
    assert info.value.code == 2
    assert words in capsys.readouterr().err
