"""The named what-if scenarios are well formed and render tables."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from sim_helpers import config

from pushkv.sim.scenarios import SCENARIOS, Scenario, main, run_scenario


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_says_what_it_shows(name: str) -> None:
    s = SCENARIOS[name]()
    assert s.name == name
    assert len(s.doc.split()) >= 8
    assert s.rows
    assert all(len(cfgs) == len(s.columns) for _, cfgs in s.rows)
    labels = [label for label, _ in s.rows]
    assert len(set(labels)) == len(labels)


def test_a_scenario_renders_one_cell_per_config() -> None:
    s = Scenario("tiny", "Two modes, one row.", ("pull", "push"),
                 (("2 QPS", (config("pull", num_prompts=4), config("push", num_prompts=4))),),
                 lambda res: str(res["completed"]))
    assert run_scenario(s).splitlines() == ["| | pull | push |", "|---|---|---|",
                                            "| 2 QPS | 4 | 4 |"]


def test_unknown_scenario_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["nonsense"])
    assert info.value.code == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_cells_are_means_over_seeds() -> None:
    from pushkv.sim import run
    from pushkv.sim.scenarios import mean_result

    cfg = config("push", num_prompts=4)
    a, b = (run(cfg.__class__(**{**cfg.__dict__, "iteration": i})).result for i in (0, 1))
    m = mean_result([a, b])
    assert m["mean_ttft_ms"] == (a["mean_ttft_ms"] + b["mean_ttft_ms"]) / 2
    assert m["completed"] == 4 and m["pushkv"]["leaked_blocks"] == 0
    s = Scenario("tiny", "One row, two seeds.", ("push",), (("2 QPS", (cfg,)),),
                 lambda res: f"{res['mean_ttft_ms']:.6f}")
    assert run_scenario(s, seeds=2).splitlines()[-1] == f"| 2 QPS | {m['mean_ttft_ms']:.6f} |"
