"""lone_steps: a gauge's step times are a lone request's wall times, the request's own
work beside its steps in them; on shared cores the model adds that work again unless the
steps are first fitted so that a lone request simulated there steps as on cores of its
own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.fit.cpu_profile import MeasurementError
from pushkv.fit.measure_connector import LONE_TOLERANCE, _lone_gap, _lone_segments, lone_steps
from pushkv.sim.profile import Profile, load_profile, profile_from_dict

TINY = load_profile(Path(__file__).resolve().parents[2] / "pushkv" / "sim" / "profiles"
                    / "cpu-tiny.toml")
STEPS = ("prefill sees -> prefill finished", "first token -> last token")


def shared(*, busy: float = 1.4, token_work_s: float = 1e-3, host_cores: int = 2,
           pinned: bool = False) -> Profile:
    """cpu-tiny on two shared cores, each engine keeping ``busy`` cores busy while it
    steps or holds a request, each token ``token_work_s`` of frontend work."""
    return profile_from_dict({
        "prefill": {"prefill_step_overhead_s": 5e-3, "step_python_s": 2.5e-3},
        "decode": {"decode_step_overhead_s": 3e-3, "step_python_s": 3e-3},
        "host": {"model": "shared-cpu", "cores": host_cores, "frontend_cores": 1,
                 "token_work_s": token_work_s, "pinned": pinned,
                 "prefill": {"cores_busy": busy, "steps_while_holding": True},
                 "decode": {"cores_busy": busy, "steps_while_holding": True}}}, base=TINY)


def own_cores(p: Profile) -> Profile:
    return dataclasses.replace(p, host=dataclasses.replace(p.host, cores=0, pinned=False))


def lone(p: Profile, mode: str) -> dict[str, float]:
    """Step segments of lone requests, sent as far apart as lone_steps sends them."""
    gap = _lone_gap(own_cores(p), mode=mode, input_len=64, output_len=24)
    return _lone_segments(p, mode=mode, input_len=64, output_len=24, gap_s=gap)


def test_without_shared_cores_the_profile_is_its_own() -> None:
    p = own_cores(shared())
    assert lone_steps(p, mode="push", input_len=64, output_len=24) is p


@pytest.mark.parametrize("pinned", [False, True], ids=["one-pool", "pinned"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_lone_request_on_shared_cores_then_steps_as_on_cores_of_its_own(
        mode: str, pinned: bool) -> None:
    """On one pool of the cores or with the engines pinned: the steps are fitted on the
    host they will run on."""
    p = shared(pinned=pinned)
    want, before = lone(own_cores(p), mode), lone(p, mode)
    # the double count this takes out: the request's own work slows its decode steps
    assert before["first token -> last token"] > 1.05 * want["first token -> last token"]
    got = lone(lone_steps(p, mode=mode, input_len=64, output_len=24), mode)
    for seg in STEPS:
        assert got[seg] == pytest.approx(want[seg], rel=2 * LONE_TOLERANCE)


def test_only_a_step_that_its_own_work_slowed_is_fitted() -> None:
    """In a push, decode holds the request while prefill steps (its loop keeps stepping),
    so prefill's step is shortened; in a pull decode has not got it yet, so prefill's step
    is the gauge's as it is; decode's is shortened in both."""
    p = shared()
    push = lone_steps(p, mode="push", input_len=64, output_len=24)
    pull = lone_steps(p, mode="pull", input_len=64, output_len=24)
    assert push.prefill.prefill_step_overhead_s < p.prefill.prefill_step_overhead_s
    assert pull.prefill.prefill_step_overhead_s == p.prefill.prefill_step_overhead_s
    for f in (push, pull):
        assert f.decode.decode_step_overhead_s < p.decode.decode_step_overhead_s
        # step_python_s keeps its share of the overhead
        assert f.decode.step_python_s == pytest.approx(f.decode.decode_step_overhead_s)
    assert push.prefill.step_python_s == pytest.approx(
        push.prefill.prefill_step_overhead_s / 2)


def test_with_no_work_beside_the_steps_nothing_changes() -> None:
    """The limiting case: an engine that keeps one core busy (its step) and tokens that
    cost the frontends nothing bring no work beside a lone request's steps."""
    p = shared(busy=1.0, token_work_s=0.0)
    f = lone_steps(p, mode="push", input_len=64, output_len=24)
    assert f.prefill.prefill_step_overhead_s == p.prefill.prefill_step_overhead_s
    assert f.decode.decode_step_overhead_s == p.decode.decode_step_overhead_s


def test_one_output_token_has_no_decode_step_to_fit() -> None:
    with pytest.raises(MeasurementError, match="2 output tokens"):
        lone_steps(shared(), mode="push", input_len=64, output_len=1)
