"""host.spread: the connector keys' host times drawn around their medians --
validated like every key, off by default, its limiting cases, and measured from a real
pair's timeline."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simpy")

import simpy
from sim_helpers import config, on_host, write_timeline

from pushkv.fit.cpu_profile import MeasurementError
from pushkv.fit.measure import main as measure_main
from pushkv.fit.measure_connector import SPREAD_KEYS, connector_keys, host_spread
from pushkv.sim.host.frontend import Frontend
from pushkv.sim.host.profile import MAX_SPREAD
from pushkv.sim.host.spread import Spread
from pushkv.sim.profile import ProfileError, load_profile, profile_from_dict
from pushkv.sim.runner import run
from pushkv.sim.scenario import Dispatch

ROOT = Path(__file__).resolve().parents[2]
TINY_PATH = ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"
TINY = load_profile(TINY_PATH)


def _with(spread: tuple[float, ...] = (), **sides: dict[str, float]):  # type: ignore[no-untyped-def]
    changes = {side: dataclasses.replace(getattr(TINY, side), **fields)
               for side, fields in sides.items()}
    return on_host(dataclasses.replace(TINY, **changes), spread=spread)


def _run(profile, mode: str = "pull", qps: float = 0.5, n: int = 12, **kw):  # type: ignore[no-untyped-def]
    cfg = dataclasses.replace(config(mode, qps=qps, input_len=128, output_len=8,
                                     num_prompts=n, **kw), profile=profile)
    return run(cfg).result


KEYED = {"prefill": {"ingest_s": 0.002, "return_s": 0.001},
         "decode": {"ingest_s": 0.003, "event_handoff_s": 0.001, "admit_lag_s": 0.001,
                    "order_handoff_s": 0.0005},
         "network": {"notify_wait_s": 0.001}}


def test_it_is_off_by_default_and_bad_values_are_refused() -> None:
    assert TINY.host.spread == ()
    assert profile_from_dict({"host": {"model": "shared-cpu", "spread": [0.5, 1, 2]}}
                             ).host.spread == (0.5, 1.0, 2.0)
    for doc, words in [
        ({"spread": [1.0, -0.5]}, "multipliers must be >= 0"),
        ({"spread": [1.0, math.nan]}, "finite"),
        ({"spread": [1.0, math.inf]}, "finite"),
        ({"spread": ["x"]}, "must be a list of numbers"),
        ({"spread": 1.5}, "must be a list of numbers"),
        ({"spread": [1.0] * (MAX_SPREAD + 1)}, f"at most {MAX_SPREAD}"),
    ]:
        with pytest.raises(ProfileError, match=words):
            profile_from_dict({"host": {"model": "shared-cpu", **doc}})


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_multipliers_of_one_give_the_old_result_exactly(mode: str) -> None:
    """Its draws come from a stream of their own: no other draw moves."""
    keyed = _with(**KEYED)
    ones = _with((1.0,) * 7, **KEYED)
    assert json.dumps(_run(ones, mode, qps=8.0, n=24)) == \
        json.dumps(_run(keyed, mode, qps=8.0, n=24))
    assert json.dumps(_run(_with((2.0, 3.0)), mode)) == json.dumps(_run(TINY, mode))


def test_a_fixed_multiplier_scales_every_keyed_time_on_the_path() -> None:
    """Sequential dispatch (pull), one key only, low load: each request's TTFT grows by
    exactly (m - 1) x the key."""
    x, m = 0.004, 3.0
    base = _run(_with(prefill={"ingest_s": x}))
    slow = _run(_with((m,), prefill={"ingest_s": x}))
    for a, b in zip(base["ttfts"], slow["ttfts"], strict=True):
        assert b - a == pytest.approx((m - 1) * x, abs=1e-6)


def test_the_mean_host_time_is_the_median_times_the_multipliers_mean() -> None:
    """Two multipliers, equally likely: over many requests the TTFT grows by about
    (mean - 1) x the key, and the spread is real (not every request alike)."""
    x = 0.004
    base = _run(_with(prefill={"ingest_s": x}), n=400, qps=0.5)
    spread = _run(_with((1.0, 3.0), prefill={"ingest_s": x}), n=400, qps=0.5)
    gains = [b - a for a, b in zip(base["ttfts"], spread["ttfts"], strict=True)]
    assert statistics.fmean(gains) == pytest.approx(x, rel=0.15)
    assert {round(g / x) for g in gains} == {0, 2}


def test_it_is_deterministic_per_seed_and_moves_with_the_seed() -> None:
    prof = _with((0.2, 1.0, 1.0, 4.0), **KEYED)
    a, b = _run(prof, "push", qps=4.0, n=30), _run(prof, "push", qps=4.0, n=30)
    assert json.dumps(a) == json.dumps(b)
    c = _run(prof, "push", qps=4.0, n=30, iteration=1)
    assert a["ttfts"] != c["ttfts"]


def test_a_stall_on_the_frontend_queue_holds_no_core() -> None:
    """The part of a draw above the median waits outside the queue: the job behind it
    starts once the work is done, not after the stall."""
    env = simpy.Environment()
    fe = Frontend(env, cores=1, token_s=0.0)
    done: dict[str, float] = {}
    fe.serve(0.001, lambda: done.setdefault("stalled", env.now), wait_s=1.0)
    fe.serve(0.001, lambda: done.setdefault("behind", env.now))
    env.run()
    assert done["behind"] == pytest.approx(0.002)
    assert done["stalled"] == pytest.approx(1.001)
    spread = Spread((0.5, 4.0), np.random.default_rng(3))
    for _ in range(50):
        work, wait = spread.split(0.002)
        assert (work, wait) in ((0.001, 0.0), (0.002, pytest.approx(0.006)))
    assert spread.split(0.0) == (0.0, 0.0) and Spread().split(0.003) == (0.003, 0.0)
    assert spread.mean == pytest.approx(2.25) and Spread().mean == 1.0


def test_on_the_frontend_queue_the_stall_delays_its_own_request() -> None:
    x = 0.004
    kw = {"prefill": {"ingest_s": x}, "decode": {"ingest_s": x}}
    queued = on_host(_with((3.0,), **kw), frontend_cores=1)
    base = on_host(_with(**kw), frontend_cores=1)
    seq = Dispatch.SEQUENTIAL
    got, ref = _run(queued, dispatch=seq, qps=0.1), _run(base, dispatch=seq, qps=0.1)
    for a, b in zip(ref["ttfts"], got["ttfts"], strict=True):  # both legs, (3 - 1) x each
        assert b - a == pytest.approx(4 * x, abs=1e-6)


# ------------------------------------------------------------ measuring it


def _requests(n: int = 8) -> dict[str, dict[str, float]]:
    """Request i's keyed segments are (1 + i / 2) times request 0's (ms offsets)."""
    base = {"prefill_seen": 6.0, "decode_seen": 9.0, "registration_handed": 1.5,
            "ready": 1.5, "decode_scheduled": 1.7, "notify_received": 4.0}
    out = {}
    for i in range(n):
        k = 1 + i / 2
        t0 = 100.0 * i
        marks = {"legs_sent": t0, "prefill_seen": t0 + k * base["prefill_seen"] / 1e3,
                 "decode_seen": t0 + k * base["decode_seen"] / 1e3}
        marks["registration_shipped"] = marks["decode_seen"]
        marks["registration_handed"] = marks["decode_seen"] + k * 1.5e-3
        marks["write_posted"] = marks["registration_handed"] + 0.005
        marks["notify_received"] = marks["write_posted"] + k * 4e-3
        marks["ready"] = marks["notify_received"] + k * 1.5e-3
        marks["ready_scheduled"] = marks["ready"] + k * 0.5e-3
        marks["decode_scheduled"] = marks["ready_scheduled"] + k * 1.2e-3
        marks["first_token"] = marks["decode_scheduled"] + 0.008
        out[f"r{i}"] = marks
    return out


def test_the_spread_is_each_keyed_time_over_its_median_pooled() -> None:
    """With nothing subtracted (no hop, wire, control latency or fixed posting in the
    profile), each key's time for request i is k_i x its median's: the pooled ratios
    are k_i / median(k), six times each, and evenly spaced quantiles pick them out."""
    bare = dataclasses.replace(TINY, network=dataclasses.replace(
        TINY.network, router_hop_s=0.0, wire_latency_s=0.0, control_latency_s=0.0,
        post_fixed_s=0.0)).validate()
    reqs = _requests()
    keys = connector_keys(reqs, bare)
    assert all(keys[side][key] > 0 for side, key in SPREAD_KEYS)
    ks = [1 + i / 2 for i in range(8)]
    assert host_spread(reqs, bare, quantiles=8) == pytest.approx(
        [k / statistics.median(ks) for k in ks], abs=1e-4)
    got = host_spread(reqs, TINY, quantiles=4)  # the hop subtracted: still sorted, about 1
    assert len(got) == 4 and list(got) == sorted(got)
    assert statistics.median(got) == pytest.approx(1.0, abs=0.2)


def test_each_key_weighs_its_median_so_the_mean_is_the_mean_total_over_the_medians() -> None:
    """One request's 'notification -> ready' (a 1.5 ms key) is about 25 times its median: the
    multipliers' mean is then the keyed times' mean total over their medians' total,
    not the mean of the ratios (where that one 30 would count as much as any other)."""
    from pushkv import timeline

    bare = dataclasses.replace(TINY, network=dataclasses.replace(
        TINY.network, router_hop_s=0.0, wire_latency_s=0.0, control_latency_s=0.0,
        post_fixed_s=0.0)).validate()
    reqs = {k: dict(r) for k, r in _requests().items()}
    late = reqs["r0"]
    shift = 30 * 1.5e-3 * 2.75 - (late["ready"] - late["notify_received"])
    for ev in ("ready", "ready_scheduled", "decode_scheduled", "first_token"):
        late[ev] += shift
    keys = connector_keys(reqs, bare)
    totals = [0.0] * len(reqs)
    for side, key in SPREAD_KEYS:
        from pushkv.fit.measure_connector import CONNECTOR_SEGMENTS

        for i, r in enumerate(reqs.values()):
            segs = timeline.segments({"r": r})
            totals[i] += sum(segs[n][0] for n in CONNECTOR_SEGMENTS[side, key]) / 1000
    medians = sum(keys[side][key] for side, key in SPREAD_KEYS)
    got = host_spread(reqs, bare, quantiles=MAX_SPREAD)
    assert statistics.fmean(got) == pytest.approx(statistics.fmean(totals) / medians,
                                                  rel=0.02)
    gaps = [r["ready"] - r["notify_received"] for r in reqs.values()]
    assert max(got) == pytest.approx(max(gaps) / statistics.median(gaps), rel=0.01)


def test_too_few_requests_or_bad_quantiles_are_refused() -> None:
    with pytest.raises(MeasurementError, match="quantiles"):
        host_spread(_requests(), TINY, quantiles=0)
    with pytest.raises(MeasurementError, match="quantiles"):
        host_spread(_requests(), TINY, quantiles=MAX_SPREAD + 1)


def test_measure_writes_it_with_the_connector_keys(tmp_path: Path) -> None:
    tl = write_timeline(tmp_path / "timeline", _requests())
    out = tmp_path / "conn.toml"
    assert measure_main(["--out", str(out), "--base", str(TINY_PATH), "--connector-timeline",
                         str(tl), "--host-spread", "10"]) == 0
    prof = load_profile(out)
    assert len(prof.host.spread) == 10 and prof.host.model == "shared-cpu"
    assert "host.spread at 10 quantiles" in out.read_text()
    with pytest.raises(SystemExit):
        measure_main(["--out", str(out), "--base", str(TINY_PATH), "--pull-timeline",
                      str(tl), "--host-spread", "10"])
