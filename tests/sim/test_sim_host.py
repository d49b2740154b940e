"""The host model behind one interface: chosen by ``host.model`` in the profile, built by
:func:`pushkv.sim.host.host_model`, a do-nothing ``dedicated`` default and the
``shared-cpu`` model with every host mechanism; keys that moved to ``[host]`` are
refused where they were, with their new place."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")

import numpy as np
import simpy
from sim_helpers import config, on_host

from pushkv.fit.cpu_profile import to_toml
from pushkv.sim.host import MODELS, host_model
from pushkv.sim.host.dedicated import Dedicated
from pushkv.sim.host.profile import MOVED
from pushkv.sim.host.shared_cpu import SharedCpu
from pushkv.sim.profile import DEFAULT, ProfileError, load_profile, profile_from_dict
from pushkv.sim.runner import run

ROOT = Path(__file__).resolve().parents[2]
TINY = load_profile(ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny-connector.toml")


def test_the_default_is_dedicated_hardware_and_runs_no_host_code() -> None:
    assert DEFAULT.host.model == "dedicated" == MODELS[0]
    host = host_model(DEFAULT, simpy.Environment(), np.random.SeedSequence(0))
    assert type(host) is Dedicated and host.profile is DEFAULT
    res = run(config("push", num_prompts=4), keep_objects=True)
    assert type(res.transport.host) is Dedicated  # type: ignore[union-attr]
    assert res.result["pushkv"]["host_busy_s"] == 0.0


def test_the_dedicated_hooks_cost_nothing() -> None:
    env = simpy.Environment()
    host = Dedicated(env, DEFAULT)
    assert host.spread(0.003) == 0.003 and host.split(0.003) == (0.003, 0.0)
    assert host.wake_s("prefill") == 0.0 and host.intake_wait("router") == 0.0
    assert list(host.thread_wake("decode")) == []
    host.beside("decode", 1.0)
    host.token(None)  # type: ignore[arg-type]
    host.drain(env)
    assert env.peek() == float("inf")  # nothing was scheduled
    got: list[float] = []
    host.answer("prefill-0", 0.002, 0.001, got.append)
    assert got == [0.003]


@pytest.mark.parametrize("mode", ["push", "pull", "pull-async"])
def test_shared_cpu_with_nothing_set_runs_exactly_as_dedicated(mode: str) -> None:
    cfg = config(mode, qps=8.0, input_len=128, output_len=8, num_prompts=16, profile=TINY)
    shared = dataclasses.replace(cfg, profile=on_host(TINY))
    assert type(run(shared, keep_objects=True).transport.host) is SharedCpu  # type: ignore[union-attr]
    assert json.dumps(run(shared).result) == json.dumps(run(cfg).result)


def test_the_profile_names_the_model_and_its_keys_load_from_toml(tmp_path: Path) -> None:
    text = """
[host]
model = "shared-cpu"
cores = 2
frontend_cores = 1
spread = [0.5, 2]

[host.decode]
cpu_share = 0.5
steps_while_holding = true
"""
    path = tmp_path / "h.toml"
    path.write_text(text)
    prof = load_profile(path)
    assert prof.host.model == "shared-cpu" and prof.host.cores == 2
    assert prof.host.spread == (0.5, 2.0)
    assert prof.host.decode.cpu_share == 0.5 and prof.host.decode.steps_while_holding
    assert prof.host.prefill.cpu_share == 1.0
    host = host_model(prof, simpy.Environment(), np.random.SeedSequence(0))
    assert type(host) is SharedCpu
    assert host.profile.host.decode.cpu_share == 1.0  # the share is in the host times now
    # the fit's writer writes the sub-tables back
    data = {"host": {"model": "shared-cpu", "cores": 2, "decode": {"cpu_share": 0.5}}}
    again = tmp_path / "again.toml"
    again.write_text(to_toml(data))
    assert "[host.decode]" in again.read_text()
    assert load_profile(again).host.decode.cpu_share == 0.5


@pytest.mark.parametrize(("section", "key"), [
    (section, key) for section, keys in MOVED.items() for key in keys])
def test_a_key_in_its_old_section_is_refused_with_its_new_place(section: str, key: str) -> None:
    with pytest.raises(ProfileError) as err:
        profile_from_dict({section: {key: 1}})
    msg = str(err.value)
    new = MOVED[section][key]
    assert f"{section}.{key}" in msg and f"host.{new}" in msg and "shared-cpu" in msg


@pytest.mark.parametrize("doc", [
    {"cores": 2}, {"frontend_cores": 1}, {"spread": [1.0, 2.0]}, {"token_work_s": 0.001},
    {"prefill": {"wake_s": 0.001}}, {"decode": {"cpu_share": 0.5}}])
def test_the_dedicated_model_refuses_the_shared_cpus_keys(doc: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ProfileError, match="model = \"shared-cpu\""):
        profile_from_dict({"host": doc})
    profile_from_dict({"host": {"model": "shared-cpu", **doc}})  # there they are fine


def test_an_unknown_model_or_sub_table_is_refused() -> None:
    with pytest.raises(ProfileError, match=r"host\.model must be one of"):
        profile_from_dict({"host": {"model": "gpu"}})
    with pytest.raises(ProfileError, match=r"\[host\.decode\] must be a table"):
        profile_from_dict({"host": {"model": "shared-cpu", "decode": 1}})
    with pytest.raises(ProfileError, match=r"unknown key host\.decode\.ingest_s"):
        profile_from_dict({"host": {"model": "shared-cpu", "decode": {"ingest_s": 1.0}}})


def test_the_bundled_profiles_load() -> None:
    for path in sorted((ROOT / "pushkv" / "sim" / "profiles").glob("*.toml")):
        load_profile(path)
