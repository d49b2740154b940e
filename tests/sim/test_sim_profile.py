"""Profiles: every number has a help string and a source; user TOML files are checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.sim.profile import (
    DEFAULT,
    ProfileError,
    describe,
    load_profile,
    profile_from_dict,
)


def test_every_default_number_has_help_and_a_source() -> None:
    rows = describe(DEFAULT)
    assert len(rows) > 30
    for name, _value, help_text, source in rows:
        assert help_text, name
        assert source, name


def test_toml_overrides_only_what_it_names(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('name = "mine"\n[model]\nnum_layers = 80\n[prefill]\n'
                 'prefix_hit_fraction = 0.5\n[network]\npost_per_descriptor_s = 3e-6\n')
    p = load_profile(f)
    assert p.name == "mine"
    assert p.model.num_layers == 80
    assert p.prefill.prefix_hit_fraction == 0.5
    assert p.network.post_per_descriptor_s == 3e-6
    # ... and the step overheads its new layer count implies (derived_step_overheads)
    assert p.decode == dataclasses.replace(
        DEFAULT.decode, **DEFAULT.decode.derived_step_overheads(p.model))
    assert p.decode.decode_step_overhead_s > DEFAULT.decode.decode_step_overhead_s
    assert p.model.head_dim == DEFAULT.model.head_dim


def test_integer_valued_floats_are_accepted_for_integers() -> None:
    assert profile_from_dict({"decode": {"max_num_seqs": 16.0}}).decode.max_num_seqs == 16


@pytest.mark.parametrize(("doc", "words"), [
    ({"modle": {}}, "unknown table"),
    ({"model": {"num_layerz": 3}}, "model.num_layerz"),
    ({"model": {"num_layers": "many"}}, "integer"),
    ({"model": {"num_layers": 1.5}}, "integer"),
    ({"gpu": {"peak_flops": "fast"}}, "number"),
    ({"decode": {"tp": True}}, "booleans"),
    ({"decode": {"max_num_seqs": 0}}, "positive"),
    ({"prefill": {"prefix_hit_fraction": 1.5}}, "[0, 1]"),
    ({"prefill": {"tp": 3}}, "does not divide"),
    ({"network": {"post_fixed_s": -1.0}}, ">= 0"),
    ({"model": 3}, "must be a table"),
    ({"name": ""}, "non-empty"),
    ({"network": {"post_fixed_s": float("nan")}}, "finite"),
    ({"network": {"router_hop_s": float("inf")}}, "finite"),
    ({"gpu": {"peak_flops": float("inf")}}, "finite"),
    ({"decode": {"prefix_hit_fraction": 0.5}}, "decode.prefix_hit_fraction is not used"),
    ({"prefill": {"inline_post": "before-forward"}}, "prefill.inline_post is not used"),
    ({"decode": {"block_size": 3}}, "power of two"),
])
def test_bad_values_name_the_key(doc: dict[str, object], words: str) -> None:
    with pytest.raises(ProfileError, match=words.replace("[", r"\[").replace("]", r"\]")):
        profile_from_dict(doc)  # type: ignore[arg-type]


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = ")
    with pytest.raises(ProfileError, match="malformed TOML"):
        load_profile(bad)


def test_the_example_profile_in_the_docs_loads(tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "sim.md"
    text = doc.read_text()
    start = text.index("```toml\n") + len("```toml\n")
    example = tmp_path / "example.toml"
    example.write_text(text[start:text.index("```", start)])
    p = load_profile(example)
    assert p.model.num_layers == 80
    assert p.network.descriptor_rate == 4e6


def test_values_set_in_code_are_checked_too() -> None:
    import dataclasses
    bad = dataclasses.replace(DEFAULT, network=dataclasses.replace(
        DEFAULT.network, control_latency_s=float("nan")))
    with pytest.raises(ProfileError, match=r"network\.control_latency_s must be a finite"):
        bad.validate()
    unused = dataclasses.replace(DEFAULT, decode=dataclasses.replace(
        DEFAULT.decode, prefix_hit_fraction=0.3))
    with pytest.raises(ProfileError, match="not used"):
        unused.validate()
    assert DEFAULT.validate() is DEFAULT


def test_every_config_error_is_the_core_one() -> None:
    from pushkv.protocol import errors
    from pushkv.sim import ConfigError, WorkloadError

    for cls in (ProfileError, ConfigError, WorkloadError):
        assert issubclass(cls, errors.ConfigError)


def test_protocol_defaults_are_the_core_ones() -> None:
    from pushkv.protocol import ConsumerConfig, ProducerConfig
    from pushkv.sim import ProtocolSettings

    s, p, c = ProtocolSettings(), ProducerConfig(), ConsumerConfig()
    assert s.lease_s == p.lease_s
    assert (s.heartbeat_s, s.window_s, s.fence_grace_s, s.policy) == (
        c.heartbeat_s, c.window_s, c.fence_grace_s, c.policy)
