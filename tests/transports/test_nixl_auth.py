"""The side channel with a shared key, across two processes (real NIXL and zmq).

Forged, replayed, truncated, stale and misaddressed frames are dropped and
counted, and change no state; transfers between keyed ranks still work; a
rank with another key cannot handshake; control messages that arrive as NIXL
notifications (not authenticated) are dropped when a key is configured.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import ConfigError, ConsumerConfig, Fail, FailReason, Register, encode
from pushkv.transports import conformance
from pushkv.transports.conformance import Topology, assert_clean, assert_destination
from pushkv.transports.nixl import NixlConfig
from pushkv.transports.nixl.sidechannel.auth import Signer, load_key
from pushkv.transports.nixl.sidechannel.channel import PeerCard, encode_card
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl

KEY = b"0123456789abcdef-pushkv-test-key"
AUTH = ("auth_failed", "auth_stale", "auth_replayed", "auth_unprotected")


@pytest.fixture
def keyed(tmp_path: Path) -> NixlConfig:
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    return NixlConfig(key_file=str(path))


def _producer(c: NixlCluster) -> dict[str, Any]:
    p, _ = c.raw_snapshot()
    return {"stats": p["stats"][0], "transfers": p["transfers"][0],
            "rejected": p["rejected"][0]}


def _until(c: NixlCluster, pred: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while True:
        got = _producer(c)
        if pred(got) or time.monotonic() > end:
            return got
        c.raw_snapshot(0.01)


def test_bad_frames_are_dropped_counted_and_change_nothing(pool: HostPool,
                                                           keyed: NixlConfig) -> None:
    c = NixlCluster(Topology(), pool, keyed)
    try:
        # Keyed ranks handshake and transfer: every frame they exchange is authenticated.
        c.register("t", [4, 5, 6], 40)
        c.prefill_finished("t", [7, 8, 9], 40)
        snap = c.wait(lambda s: s.outcome(0, "t") == "ready", 10)
        assert snap.outcome(0, "t") == "ready", snap.outcomes
        assert_destination(c, [([7, 8, 9], [4, 5, 6], 40, 0)])
        before = _producer(c)
        assert before["stats"].get("control_frames", 0) >= 1
        assert not any(before["stats"].get(k, 0) for k in AUTH), before["stats"]

        me = "prefill-0/0"
        reg = encode(Register(transfer_id="x", attempt=0, engine_id="decode-0", rank=0,
                              producer_engine_id="prefill-0", block_ids=(1, 2), num_tokens=20))
        tag = Signer(KEY, me).sign(b"C", reg)  # authentic: as if captured on the wire
        card = encode_card(PeerCard(hello=b"h", address="tcp://127.0.0.1:1", agent_name="a",
                                    agent_metadata=b"m", bases=(1,), sizes=(1,), kind="DRAM"))
        bad = [
            [b"C", reg],  # no tag
            [b"H", card],  # a card without a tag
            [b"C", reg, Signer(b"another key, 32 bytes long......", me).sign(b"C", reg)],
            [b"C", reg[:-3], tag],  # body truncated
            [b"C", reg + b"\0", tag],  # body extended
            [b"C", reg, tag[:-1]],  # tag truncated
            [b"H", reg, tag],  # kind changed
            [b"C", reg, Signer(KEY, "prefill-0/1").sign(b"C", reg)],  # for another rank
        ]
        stale = [b"C", reg, Signer(KEY, me).sign(b"C", reg, timestamp=time.time() - 3600)]
        for parts in [*bad, stale]:
            c.send_raw(c.producer_addresses[0], parts)
        after = _until(c, lambda s: s["stats"].get("auth_failed", 0) >= len(bad)
                       and s["stats"].get("auth_stale", 0) >= 1)
        assert after["stats"].get("auth_failed") == len(bad), after["stats"]
        assert after["stats"].get("auth_stale") == 1, after["stats"]
        for key in ("control_frames", "peers_accepted", "rejected", "stale_cards"):
            assert after["stats"].get(key, 0) == before["stats"].get(key, 0), key
        assert after["transfers"] == before["transfers"]
        assert after["rejected"] == before["rejected"] == 0

        # The authentic frame is accepted once (so the drops above were not for want
        # of a valid frame); replaying it changes nothing.
        c.send_raw(c.producer_addresses[0], [b"C", reg, tag])
        once = _until(c, lambda s: s["transfers"] == before["transfers"] + 1)
        assert once["transfers"] == before["transfers"] + 1
        for _ in range(2):
            c.send_raw(c.producer_addresses[0], [b"C", reg, tag])
        again = _until(c, lambda s: s["stats"].get("auth_replayed", 0) >= 2)
        assert again["stats"].get("auth_replayed") == 2, again["stats"]
        assert again["transfers"] == once["transfers"]
        assert again["stats"]["control_frames"] == once["stats"]["control_frames"]

        c.register("u", [10, 11, 12], 40)
        c.prefill_finished("u", [20, 21, 22], 40)
        snap = c.wait(lambda s: s.outcome(0, "u") == "ready", 10)
        assert snap.outcome(0, "u") == "ready", snap.outcomes
        assert_clean(c)
    finally:
        c.close()


def test_ranks_with_different_keys_never_handshake(pool: HostPool, keyed: NixlConfig,
                                                   tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"a different key, also long enough")
    cons = NixlConfig(key_file=str(other))
    topo = Topology(consumer_config=ConsumerConfig(handshake_timeout_s=0.5))
    c = NixlCluster(topo, pool, keyed, connect="lazy", consumer_nixl=cons)
    try:
        c.register("t", [1, 2, 3], 40)
        snap = c.wait(lambda s: s.outcome(0, "t") == "failed" and not any(s.lent.values()), 10)
        assert snap.outcomes.get((0, "t")) == [("failed", 0)], snap.outcomes
        assert snap.dst_released.get((0, "t", 0)) == 1
        p, cons_view = c.raw_snapshot()
        assert cons_view["fail_codes"][0, "t"] == ["HANDSHAKE_FAILED"]
        assert p["stats"][0].get("auth_failed", 0) >= 1  # the consumer's card
        assert p["stats"][0].get("peers_accepted", 0) == 0
    finally:
        c.close()


def test_control_messages_as_nixl_notifications_are_dropped(pool: HostPool,
                                                            keyed: NixlConfig) -> None:
    """NIXL notifications are not authenticated: with a key, only write
    notifications may arrive that way; a Fail sent as one changes nothing."""
    c = NixlCluster(Topology(), pool, keyed)
    try:
        c.register("t", [4, 5, 6], 40)
        fail = Fail(transfer_id="t", attempt=0, engine_id="prefill-0", rank=0,
                    reason=FailReason.PREFILL_ABORTED)
        c.inject("consumer", 0, "notify", encode(fail))
        end = time.monotonic() + 10
        while True:
            _, cons = c.raw_snapshot(0.01)
            if cons["stats"][0].get("auth_unprotected", 0) or time.monotonic() > end:
                break
        assert cons["stats"][0].get("auth_unprotected") == 1, cons["stats"][0]
        c.prefill_finished("t", [7, 8, 9], 40)
        snap = c.wait(lambda s: s.outcome(0, "t") == "ready", 10)
        assert snap.outcomes.get((0, "t")) == [("ready", 0)], snap.outcomes
        assert_clean(c)
    finally:
        c.close()


def test_key_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUSHKV_TEST_KEY", raising=False)
    assert load_key("", "PUSHKV_TEST_KEY") is None
    monkeypatch.setenv("PUSHKV_TEST_KEY", "  from-the-environment-0123  ")
    assert load_key("", "PUSHKV_TEST_KEY") == b"from-the-environment-0123"
    path = tmp_path / "k"
    path.write_bytes(KEY + b"\n")
    assert load_key(str(path), "PUSHKV_TEST_KEY") == KEY  # the file wins
    monkeypatch.setenv("PUSHKV_TEST_KEY", "short-secret")
    with pytest.raises(ConfigError, match="shorter than 16") as short:
        load_key("", "PUSHKV_TEST_KEY")
    assert "short-secret" not in str(short.value)
    with pytest.raises(ConfigError, match="key_file"):
        load_key(str(tmp_path / "missing"), "")
    cfg = NixlConfig(key_file=str(path))
    assert KEY.decode() not in repr(cfg)


@pytest.mark.parametrize("name", ["reissue", "cancel", "prefill_aborted", "producer_killed",
                                  "transfer_tp2-1", "transfer_tp1-2"])
def test_conformance_with_a_key(pool: HostPool, keyed: NixlConfig, name: str) -> None:
    """The protocol works unchanged over an authenticated side channel."""
    fn, kwargs = conformance.CHECKS[name]
    fn(lambda topo: NixlCluster(topo, pool, keyed), **kwargs)
