"""The sim, sweep and plot subcommands, their help and their refusals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.sim import SimConfig, TransferMode, WorkloadConfig, run
from pushkv.sim.cli import main, register
from pushkv.sim.sweep import SweepSpec, configs, run_sweep


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0)


@pytest.mark.parametrize("command", ["sim", "sweep", "plot"])
def test_help_explains_every_knob(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code([command, "--help"]) == 0
    out = capsys.readouterr().out
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
            assert action.option_strings[-1] in out


@pytest.mark.parametrize(("argv", "words"), [
    (["sim", "--qps", "-1"], "must be > 0"),
    (["sim", "--qps", "nan"], "NaN"),
    (["sim", "--mode", "teleport"], "unknown mode"),
    (["sim", "--input-len", "0"], "must be >= 1"),
    (["sim", "--profile", "/no/such/profile.toml"], "profile file not found"),
    (["sim", "--drop-register", "2"], "[0, 1]"),
    (["sweep", "--rates", "1", "-4"], "must be > 0"),
    (["sweep", "--modes", "pull", "bogus"], "unknown mode"),
    (["plot", "--results-dir", "/no/such/dir", "--metric", "ttft"], "not found"),
    (["plot", "--results-dir", ".", "--metric", "speed"], "invalid choice"),
])
def test_bad_input_exits_2_with_a_message(argv: list[str], words: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert words in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("text", "words"), [
    ("[network]\npost_fixed_s = nan\n", "network.post_fixed_s must be a finite number"),
    ("[network]\nrouter_hop_s = inf\n", "network.router_hop_s must be a finite number"),
    ("[decode]\nprefix_hit_fraction = 0.5\n", "decode.prefix_hit_fraction is not used"),
    ("[decode]\nblock_size = 3\n", "decode.block_size must be a power of two"),
])
def test_impossible_profiles_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    f = tmp_path / "p.toml"
    f.write_text(text)
    assert _exit_code(["sim", "--profile", str(f), "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and "Traceback" not in "\n".join(err)


def test_malformed_profile_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("[network]\npost_per_descriptor_s = 'slow'\n")
    assert _exit_code(["sim", "--profile", str(bad)]) == 2
    assert "network.post_per_descriptor_s must be a number" in capsys.readouterr().err
    bad.write_text("[network\n")
    assert _exit_code(["sim", "--profile", str(bad)]) == 2
    assert "malformed TOML" in capsys.readouterr().err


def test_sim_prints_a_summary_and_writes_the_result(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--mode", "pull", "--qps", "4", "--input-len", "2048", "--output-len",
               "16", "--num-prompts", "10", "--result-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Mean TTFT (ms)" in out and "Leaked blocks:" in out
    data = json.loads((tmp_path / "pull_qps4_in2048_out16_iter0.json").read_text())
    assert data["completed"] == 10
    expected = run(SimConfig(mode=TransferMode.PULL, workload=WorkloadConfig(
        request_rate=4, input_len=2048, output_len=16, num_prompts=10))).result
    assert data == json.loads(json.dumps(expected))


def test_push_seq_label_and_knobs_reach_the_config(tmp_path: Path) -> None:
    rc = main(["sim", "--mode", "push-seq", "--num-prompts", "5", "--output-len", "4",
               "--prefix-hit", "0.5", "--fragmentation", "0", "--result-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "push-seq_qps1_in1024_out4_iter0.json").read_text())
    assert data["pushkv"]["dispatch"] == "sequential"
    assert data["pushkv"]["prefix_hit_fraction"] == 0.5
    assert data["pushkv"]["descriptors_mean"] == 128  # contiguous: one per region


def test_sweep_in_two_processes_equals_runs_in_one(tmp_path: Path) -> None:
    spec = SweepSpec(modes=("pull", "push"), input_lens=(1024, 4096), rates=(2.0,),
                     output_len=8, num_prompts=8)
    cfgs = configs(spec)
    paths, _ = run_sweep(cfgs, tmp_path, jobs=2, progress=False)
    assert [p.name for p in paths] == sorted(c.file_name() for c in cfgs)
    for cfg in cfgs:
        written = json.loads((tmp_path / cfg.file_name()).read_text())
        assert written == json.loads(json.dumps(run(cfg).result))


def test_sweep_then_plot_from_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    assert main(["sweep", "--modes", "pull", "push", "pull-async", "--input-lens", "1024",
                 "2048", "--rates", "1", "4", "--output-len", "8", "--num-prompts", "6",
                 "--iterations", "2", "--jobs", "1", "--no-progress", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.glob("*.json"))
    assert len(files) == 24
    assert "24 points" in capsys.readouterr().out
    # Each iteration is its own seed: one file per iteration, different arrivals.
    a, b = (json.loads((out / f"push_qps4_in1024_out8_iter{n}.json").read_text())
            for n in (0, 1))
    assert a["start_times"] != b["start_times"]
    for metric in ("ttft", "tpot"):
        assert main(["plot", "--results-dir", str(out), "--metric", metric]) == 0
        assert (out / f"{metric}.png").stat().st_size > 10_000


def test_registering_the_commands_needs_neither_simpy_nor_matplotlib() -> None:
    """The ``pushkv`` entry point can add these commands without the sim extra."""
    import subprocess
    import sys

    code = ("import sys, argparse; from pushkv.sim.cli import register; "
            "register(argparse.ArgumentParser().add_subparsers()); "
            "print(sorted(m for m in ('simpy', 'matplotlib', 'tqdm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"
