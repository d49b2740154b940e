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
