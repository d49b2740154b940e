"""The connector's configuration keys and the kv_transfer_params of both legs."""

from __future__ import annotations

import pytest

from pushkv.protocol import ConfigError, FailurePolicy
from pushkv.vllm.config import (
    ConnectorConfigError,
    PushKVSettings,
    failure_policy,
    parse_cpus,
)
from pushkv.vllm.params import (
    DecodeLeg,
    Discover,
    Endpoint,
    NixlPrefillLeg,
    ParamsError,
    PrefillLeg,
    parse_params,
    with_ranks,
)

P = Endpoint(engine_id="prefill-0", host="10.1.2.3", port=5600, tp_size=2)


def test_defaults_are_valid_and_documented():
    s = PushKVSettings.from_extra_config(None)
    assert (s.backend, s.side_channel_port, s.key_file) == ("UCX", 0, "")
    assert set(PushKVSettings.help()) == {
        "backend", "side_channel_host", "side_channel_port", "key_file", "key_env",
        "lease_s", "retarget_hold_s", "window_s",
        "fence_grace_s", "heartbeat_s", "handshake_timeout_s", "write_timeout_s",
        "peer_confirm_s", "max_pending_registrations", "notify_poll_ms", "progress_delay_us",
        "transport_cpus", "direction", "push_granularity", "pack", "staging_bytes",
        "pipeline_bytes", "backend_options", "integrity", "integrity_inject", "timeline_dir"}
    assert all(PushKVSettings.help().values())
    assert s.packing() is not None and s.packing().pipeline_bytes == 4 << 20


def test_pipeline_bytes_reach_the_endpoints_and_bad_values_are_refused():
    s = PushKVSettings.from_extra_config({"pipeline_bytes": "0"})
    assert s.producer_config().packing.pipeline_bytes == 0  # one chunk
    with pytest.raises(ConnectorConfigError, match="pipeline_bytes"):
        PushKVSettings.from_extra_config({"pipeline_bytes": -1})


def test_values_are_coerced_from_json_and_strings():
    s = PushKVSettings.from_extra_config({
        "backend": ["libfabric"], "side_channel_port": "6000", "lease_s": 12,
        "window_s": "5.5", "backend_options": {"num_threads": 4}})
    assert (s.backend, s.side_channel_port, s.lease_s, s.window_s) == ("LIBFABRIC", 6000,
                                                                        12.0, 5.5)
    assert s.backend_options == {"num_threads": "4"}
    assert s.consumer_config(FailurePolicy.RECOMPUTE).policy is FailurePolicy.RECOMPUTE
    assert s.producer_config().lease_s == 12.0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"leas_s": 1}, "unknown kv_connector_extra_config key"),
        ({"backend": "GDS"}, "backend must be one of"),
        ({"backend": 3}, "backend must be a string"),
        ({"side_channel_port": -1}, "side_channel_port"),
        ({"side_channel_port": True}, "side_channel_port must be a int"),
        ({"lease_s": -1}, "lease_s must be a positive number"),
        ({"window_s": float("inf")}, "window_s must be a positive number"),
        ({"heartbeat_s": 30, "lease_s": 30}, "heartbeat_s"),
        ({"side_channel_host": ""}, "side_channel_host"),
        ({"max_pending_registrations": 0}, "max_pending_registrations"),
        ({"progress_delay_us": -5}, "progress_delay_us"),
        ({"backend_options": ["x"]}, "backend_options"),
        ({"transport_cpus": "3-1"}, "transport_cpus"),
        ({"transport_cpus": "all"}, "transport_cpus"),
        ({"push_granularity": "token"}, "push_granularity must be one of 'request', 'chunk'"),
        ({"push_granularity": 2}, "push_granularity must be a string"),
    ],
)
def test_bad_values_name_their_key(extra, match):
    with pytest.raises(ConnectorConfigError, match=match) as info:
        PushKVSettings.from_extra_config(extra)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_push_granularity_defaults_to_whole_requests():
    assert PushKVSettings().push_granularity == "request"
    for value in ("request", "chunk", "layer"):
        assert PushKVSettings.from_extra_config(
            {"push_granularity": value}).push_granularity == value


def test_protocol_and_transport_defaults_are_the_core_and_runtime_ones():
    from pushkv.protocol import ConsumerConfig, PackingConfig, ProducerConfig
    from pushkv.transports.nixl.config import NixlConfig

    s = PushKVSettings()
    # The connector registers staging memory (PackingConfig's defaults); the core's
    # endpoints have none unless their driver gives them some.
    assert s.producer_config() == ProducerConfig(packing=PackingConfig())
    assert s.consumer_config(FailurePolicy.FAIL) == ConsumerConfig(packing=PackingConfig())
    n = NixlConfig()
    assert (s.side_channel_host, s.side_channel_port, s.key_env, s.write_timeout_s,
            s.peer_confirm_s, s.progress_delay_us) == (
        n.host, n.port, n.key_env, n.write_timeout_s, n.peer_confirm_s, n.progress_delay_us)


def test_a_short_key_file_is_refused_naming_the_setting(tmp_path):
    (tmp_path / "k").write_text("short")
    s = PushKVSettings.from_extra_config({"key_file": str(tmp_path / "k")})
    with pytest.raises(ConnectorConfigError, match="key") as info:
        s.load_key()
    assert "short" not in str(info.value).replace("shorter", "")  # never the key itself
    (tmp_path / "k").write_text("a" * 32 + "\n")
    assert s.load_key() == b"a" * 32


def test_cpu_lists():
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpus("5") == {5}


def test_failure_policy_names():
    assert failure_policy("fail") is FailurePolicy.FAIL
    assert failure_policy("recompute") is FailurePolicy.RECOMPUTE
    with pytest.raises(ConnectorConfigError, match="kv_load_failure_policy"):
        failure_policy("retry")


def test_legs_round_trip():
    for leg in (PrefillLeg(transfer_id="t1"), DecodeLeg(transfer_id="t1", producer=P),
                Discover()):
        assert parse_params(leg.to_params()) == leg
    assert P.addresses() == {0: "tcp://10.1.2.3:5600", 1: "tcp://10.1.2.3:5601"}
    bound = with_ranks(P, {1: "tcp://10.1.2.3:41002", 0: "tcp://10.1.2.3:39001"})
    assert bound.addresses() == {0: "tcp://10.1.2.3:39001", 1: "tcp://10.1.2.3:41002"}
    assert bound.port == 39001
    leg = DecodeLeg(transfer_id="t", producer=bound)
    assert parse_params(leg.to_params()) == leg


def test_other_connectors_params_are_not_ours():
    assert parse_params(None) is None
    assert parse_params({}) is None
    # vLLM's NIXL PD prefill leg is answered (a sequential router's); its decode leg
    # without pushkv's transfer id is another connector's answer.
    assert isinstance(parse_params({"do_remote_decode": True}), NixlPrefillLeg)
    assert parse_params({"do_remote_prefill": True, "remote_engine_id": "x"}) is None


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ([1, 2], "must be an object"),
        ({"do_remote_decode": True, "transfer_id": 7}, "transfer_id"),
        ({"do_remote_decode": True, "transfer_id": "x" * 300}, "transfer_id"),
        ({"do_remote_prefill": True, "do_remote_decode": True, "transfer_id": "t"}, "both"),
        ({"do_remote_prefill": True, "transfer_id": "t"}, "producer"),
        ({"do_remote_prefill": True, "transfer_id": "t", "producer": "p"}, "object"),
        ({"do_remote_prefill": True, "transfer_id": "t",
          "producer": {"engine_id": "p", "host": "h", "port": 99999}}, "port"),
        ({"do_remote_prefill": True, "transfer_id": "t",
          "producer": {"engine_id": "p", "host": "h", "port": 65535, "tp_size": 2}}, "ports"),
        ({"do_remote_prefill": True, "transfer_id": "t",
          "producer": {"engine_id": "p", "host": "h", "port": 1, "role": "x"}}, "role"),
        ({"do_remote_prefill": True, "transfer_id": "t",
          "producer": {"engine_id": "p", "host": "h", "port": 1, "tp_size": 2,
                       "ranks": ["tcp://h:1"]}}, "one address per rank"),
        ({"do_remote_prefill": True, "transfer_id": "t",
          "producer": {"engine_id": "p", "host": "h", "port": 1,
                       "ranks": ["ipc:///tmp/x"]}}, "not an address"),
    ],
)
def test_malformed_params_are_refused(params, match):
    with pytest.raises(ParamsError, match=match):
        parse_params(params)


def test_every_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    missing = [k for k in PushKVSettings.help() if f"| `{k}` |" not in doc]
    assert missing == []


def test_direction_is_checked():
    assert PushKVSettings.from_extra_config({"direction": "push"}).direction == "push"
    with pytest.raises(ConnectorConfigError, match="direction"):
        PushKVSettings.from_extra_config({"direction": "sideways"})


def test_pack_is_the_packing_configs_setting():
    from pushkv.protocol import PackingConfig

    default = PushKVSettings.from_extra_config(None)
    assert (default.pack, default.staging_bytes) == (PackingConfig().mode,
                                                     PackingConfig().staging_bytes)
    s = PushKVSettings.from_extra_config({"pack": "always", "staging_bytes": "1048576"})
    assert s.producer_config().packing == s.consumer_config(FailurePolicy.FAIL).packing == (
        PackingConfig(mode="always", staging_bytes=1 << 20))
    never = PushKVSettings.from_extra_config({"pack": "never"})
    assert never.producer_config().packing is None and never.packing() is None
    for bad in ({"pack": "sometimes"}, {"staging_bytes": -1}):
        with pytest.raises(ConnectorConfigError, match="pack"):
            PushKVSettings.from_extra_config(bad)


def test_integrity_settings_are_checked_and_reach_the_transport():
    from pushkv.integrity import DEFAULT_MODE

    assert PushKVSettings.from_extra_config(None).integrity == DEFAULT_MODE
    s = PushKVSettings.from_extra_config({"integrity": "sample:4", "integrity_inject": "flip:10"})
    assert (s.integrity, s.integrity_inject) == ("sample:4", "flip:10")
    for bad in ({"integrity": "always"}, {"integrity": "on:3"}, {"integrity": 1},
                {"integrity_inject": "melt"}, {"integrity_inject": "flip:x"}):
        with pytest.raises(ConnectorConfigError, match="integrity"):
            PushKVSettings.from_extra_config(bad)
