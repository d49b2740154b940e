"""Honest profiles: ignored keys refused or warned, the profile in effect printed with
its origins (and loading back to the same run), inherited hardware keys named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.sim.cli import main
from pushkv.sim.host.profile import HostProfile
from pushkv.sim.profile import DEFAULT, ProfileError, load_profile
from pushkv.sim.provenance import BUILTIN, HARDWARE_BOUND, OTHER_SETTING, resolve, to_toml
from pushkv.sim.sections import UNUSED

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "pushkv" / "sim" / "profiles"


def _write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _toml(v: object) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return repr(v)


@pytest.mark.parametrize(("section", "key"), [
    (side, key) for side, keys in UNUSED.items() for key in keys])
def test_every_key_no_configuration_reads_is_refused(tmp_path: Path, section: str,
                                                     key: str) -> None:
    value = getattr(getattr(DEFAULT, "decode" if section == "prefill" else "prefill"), key)
    path = _write(tmp_path, f"[{section}]\n{key} = {_toml(value)}\n")
    with pytest.raises(ProfileError, match=re.escape(f"{section}.{key} is not used")):
        resolve(path)


@pytest.mark.parametrize("key", [k for k in vars(HostProfile()) if k != "model"])
def test_host_keys_of_the_dedicated_model_are_refused(tmp_path: Path, key: str) -> None:
    value = {"prefill": None, "decode": None, "pinned": "true"}.get(key, 1)
    if value is None:
        path = _write(tmp_path, f"[host.{key}]\ncpu_share = 0.5\n")
    elif key in ("spread", "wake_beside_s"):
        path = _write(tmp_path, f"[host]\n{key} = [0.5, 1.5]\n")
    else:
        path = _write(tmp_path, f"[host]\n{key} = {value}\n")
    with pytest.raises(ProfileError, match=r"dedicated|shared-cpu"):
        resolve(path)


_OTHER = {  # key -> (a value, the setting under which the key is ignored)
    "network.descriptor_rate": ("2e6", ""),
    "network.write_bandwidth": ("1e9", ""),
    "network.point_sizes_bytes": ("[65536, 131072]", 'wire_model = "two-limits"\n'),
    "network.point_write_bandwidth": ("[1e9, 2e9, 3e9, 4e9, 5e9, 6e9]",
                                      'wire_model = "two-limits"\n'),
    "network.rank_skew_dist": ('"fixed"', ""),
}


@pytest.mark.parametrize("dotted", sorted(OTHER_SETTING))
def test_a_key_only_another_setting_uses_is_warned_with_that_setting(
        tmp_path: Path, dotted: str) -> None:
    assert set(_OTHER) == set(OTHER_SETTING)
    value, setting = _OTHER[dotted]
    section, key = dotted.split(".")
    if key == "point_sizes_bytes":
        value = "[65536, 131072, 262144, 524288, 1048576, 4194304]"
    r = resolve(_write(tmp_path, f"[{section}]\n{setting}{key} = {value}\n"))
    [line] = r.warnings
    assert dotted in line and OTHER_SETTING[dotted][0] in line and "ignored" in line
    # under the setting that uses it, no warning
    uses = {"network.rank_skew_dist": "rank_skew = 0.1\n",
            "network.descriptor_rate": 'wire_model = "two-limits"\n',
            "network.write_bandwidth": 'wire_model = "two-limits"\n'}.get(dotted, "")
    r = resolve(_write(tmp_path, f"[{section}]\n{uses}{key} = {value}\n"))
    assert r.warnings == ()


def test_the_docs_bandwidth_only_profile_changes_nothing_and_says_so(tmp_path: Path) -> None:
    r = resolve(_write(tmp_path, "[network]\nwrite_bandwidth = 1e9\n"))
    assert "two-limits" in r.warnings[0]


def test_a_new_model_inheriting_the_tp8_node_is_warned(tmp_path: Path) -> None:
    r = resolve(_write(tmp_path, 'name = "h100"\n[gpu]\nmemory_bytes = 80e9\n'))
    [line] = r.warnings
    for key in HARDWARE_BOUND:
        assert key in line
    assert "decode.decode_step_overhead_s = 0.0038" in line
    # a new layer count derives the step overheads (not inherited); the rest is named
    r = resolve(_write(tmp_path, 'name = "llama8b"\n[model]\nnum_layers = 32\n'))
    [line] = r.warnings
    overheads = {"prefill.prefill_step_overhead_s", "decode.decode_step_overhead_s"}
    for key in HARDWARE_BOUND:
        assert (key in line) == (key not in overheads)
    assert r.origin("decode.decode_step_overhead_s").startswith("derived from")
    full = ('name = "llama8b"\n[model]\nnum_layers = 32\n[network]\ngpus_per_node = 1\n'
            + "".join(f"[{s}]\ntp = 1\nmax_num_seqs = 64\nprefill_step_overhead_s = 0.01\n"
                      for s in ("prefill",))
            + "[decode]\ntp = 1\nmax_num_seqs = 64\ndecode_step_overhead_s = 0.002\n")
    assert resolve(_write(tmp_path, full)).warnings == ()
    assert resolve(PROFILES / "cpu-tiny.toml").warnings == ()


def test_print_profile_names_every_origin(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = PROFILES / "cpu-tiny.toml"
    assert main(["sim", "--profile", str(path), "--prefix-hit", "0.25", "--print-profile"]) == 0
    out = capsys.readouterr().out
    assert f'name = "cpu-tiny"  # file {path}' in out
    assert "prefix_hit_fraction = 0.25  # flag --prefix-hit" in out
    assert f"ingest_s = 0.0  # {BUILTIN}" in out
    for side, keys in UNUSED.items():  # never written: a profile may not set them
        block = out.split(f"[{side}]\n")[1].split("\n[")[0]
        for key in keys:
            assert f"\n{key} =" not in "\n" + block


@pytest.mark.parametrize(("profile", "flags"), [
    (None, []),
    ("cpu-tiny-connector.toml", ["--prefix-hit", "0.25", "--fragmentation", "0.3"]),
    ("cpu-tiny.toml", ["--post-per-descriptor-us", "7"]),
])
def test_the_printed_profile_reproduces_the_run_byte_for_byte(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], profile: str | None,
        flags: list[str]) -> None:
    given = ["--profile", str(PROFILES / profile)] if profile else []
    assert main(["sim", *given, *flags, "--print-profile"]) == 0
    printed = _write(tmp_path, capsys.readouterr().out, "printed.toml")
    again = resolve(printed)
    assert again.warnings == ()
    if not flags:
        assert again.profile == resolve(PROFILES / profile if profile else None).profile
    point = ["--mode", "pull", "--qps", "4", "--input-len", "2048", "--output-len", "8",
             "--num-prompts", "6"] if profile is None else [
        "--mode", "push", "--qps", "2", "--input-len", "64", "--output-len", "8",
        "--num-prompts", "8"]
    assert main(["sim", *given, *flags, *point, "--result-dir", str(tmp_path / "a")]) == 0
    assert main(["sim", "--profile", str(printed), *point,
                 "--result-dir", str(tmp_path / "b")]) == 0
    [a] = (tmp_path / "a").iterdir()
    [b] = (tmp_path / "b").iterdir()
    assert a.name == b.name and a.read_bytes() == b.read_bytes()


def test_to_toml_of_the_default_loads_back_to_it(tmp_path: Path) -> None:
    printed = _write(tmp_path, to_toml(resolve()))
    assert load_profile(printed) == DEFAULT


def test_the_summary_names_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--profile", str(PROFILES / "cpu-tiny.toml"), "--input-len", "64",
                 "--output-len", "4", "--num-prompts", "2"]) == 0
    assert "Profile:" in capsys.readouterr().out.split("\n")[1]


def test_the_docs_example_profile_earns_only_the_node_size_warning(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "sim.md").read_text()
    start = text.index("```toml\n") + len("```toml\n")
    r = resolve(_write(tmp_path, text[start:text.index("```", start)]))
    assert r.profile.network.wire_model == "two-limits"
    [line] = r.warnings  # 8 GPUs a node, like the built-in one: said, not refused
    assert "network.gpus_per_node = 8" in line and "prefill.tp" not in line


def test_the_shipped_8b_example_earns_no_warning() -> None:
    r = resolve(PROFILES / "llama-3.1-8b-h100-ib.toml")
    assert r.warnings == ()
    assert r.profile.prefill.tp == 1 and r.profile.network.wire_model == "two-limits"
