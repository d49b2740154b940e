"""The model checker explores the CI scopes to completion and finds nothing.

Each scope is explored exhaustively (breadth-first, canonical states) with the
real endpoints; every promise of docs/protocol.md is checked in every state
and at every final state. A scope that finds a bug of today's core is marked
xfail(strict=True) with the bug: it turns into a failure as soon as the core
is fixed, so the mark cannot outlive the bug.
"""

from __future__ import annotations

import pytest

from pushkv.protocol import states
from pushkv.protocol.check import CI_SCOPES, Model, explore, main, replay, scope
from pushkv.protocol.states import ConsumerEffect, ConsumerInput, ConsumerState

#: Distinct states each scope reaches today: a checker that silently explores
#: less (a step that stopped being enabled, a broken snapshot) fails here.
FLOORS = {
    "1to1": 40_000,
    "1to1-net": 30_000,
    "1to1-faults": 10_000,
    "1to1-reuse": 35_000,
    "abandon": 20_000,
    "two-ids": 120_000,
    "1to1-preempt-death": 25_000,
    "pull": 200_000,
    "pull-net": 85_000,
    "pull-reuse": 35_000,
    "1to2": 30_000,
    "2to1": 20_000,
    "replicated": 5_000,
    "replicated-reuse": 80_000,
    "handshake": 3_000,
    "partial": 85_000,
    "partial-faults": 30_000,
    "partial-net": 30_000,
    "partial-2to1": 20_000,
    "partial-reuse": 100_000,
    "packed": 130_000,
    "packed-net": 6_000,
    "packed-faults": 120_000,
    "packed-2to1": 50_000,
    "packed-chunked": 400_000,
    "packed-chunked-faults": 380_000,
    "retarget": 40_000,
    "retarget-linger": 80_000,
}

#: Scopes that find a bug of today's core: scope name -> the bug.
KNOWN: dict[str, str] = {}


def _params():
    for name in CI_SCOPES:
        marks = [pytest.mark.slow] if FLOORS[name] >= 50_000 else []
        if name in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[name]))
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_scope_has_no_violation(name):
    res = explore(CI_SCOPES[name])
    assert not res.violations, res.violations[0].report()
    assert res.complete
    assert res.states >= FLOORS[name], res.summary()
    assert res.finals > 0


def test_ci_scopes_reach_enough_states():
    assert sum(FLOORS.values()) >= 100_000
    assert set(FLOORS) == set(CI_SCOPES)


def test_snapshots_are_canonical_and_restore_exactly():
    model = Model(scope("2to1"))
    state = model.root
    for _ in range(6):  # walk a few steps, always taking the first one
        state = model.apply(state, model.steps(state)[0])
    for i, sid in enumerate(state[0]):
        model.snaps.load(i, sid)
        assert model.snaps.save(i) == sid  # restoring then saving changes nothing
    again = model.root
    for _ in range(6):
        again = model.apply(again, model.steps(again)[0])
    assert again == state and hash(again) == hash(state)


def _ready_early(monkeypatch):
    monkeypatch.setitem(states.CONSUMER_TABLE,
                        (ConsumerState.REGISTERED, ConsumerInput.NOTIFY),
                        (ConsumerEffect.READY, ConsumerState.READY))


def test_a_violation_is_printed_as_the_shortest_numbered_trace(monkeypatch, capsys):
    _ready_early(monkeypatch)
    assert main(["2to1", "--progress", "0"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION (bytes): D0 declared t#0 attempt 0 READY" in out
    # Weak visibility: the write's two pieces land one by one before the notification.
    assert "shortest trace, 6 steps:" in out
    for n in range(1, 7):
        assert f"  {n}. [t=0] " in out
    assert "!! bytes:" in out


def test_depth_first_finds_the_same_shortest_trace(monkeypatch):
    _ready_early(monkeypatch)
    bfs = explore(scope("2to1"))
    dfs = explore(scope("2to1"), order="dfs")
    assert bfs.violations[0].kind == dfs.violations[0].kind == "bytes"
    assert len(bfs.violations[0].steps) == len(dfs.violations[0].steps) == 6
    story = replay(scope("2to1"), bfs.violations[0].steps)
    assert story == bfs.violations[0].story


def test_command_line_lists_scopes_and_reports_json(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in CI_SCOPES)
    assert main(["replicated", "--progress", "0", "--json", "--prefill-aborts", "0"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith('{"states_explored": ') and '"violations": 0' in last


@pytest.mark.parametrize("name", ["handshake", "replicated", "packed-net"])
def test_eager_visibility_still_explores_without_a_violation(name):
    """The kinder world (a write lands whole, then completes) stays an option: it
    explores no more states than the adversarial one and finds nothing either."""
    from dataclasses import replace

    eager = explore(replace(CI_SCOPES[name], visibility="eager"))
    weak = explore(CI_SCOPES[name])
    assert not eager.violations and eager.complete, eager.summary()
    assert 0 < eager.states <= weak.states



@pytest.mark.parametrize("argv", [["nosuch"], ["handshake", "--p-tp", "0"],
                                  ["handshake", "--visibility", "psychic"]])
def test_bad_command_lines_are_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--progress", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m pushkv.protocol.check: error:")
    assert "Traceback" not in err[0]


def test_an_ok_run_names_the_invariants_it_checked(capsys):
    assert main(["handshake", "--progress", "0"]) == 0
    out = capsys.readouterr().out
    assert "invariants checked in every state: bytes" in out and "reuse" in out
