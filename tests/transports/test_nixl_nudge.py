"""Nudges: a producer tells its consumer a write is coming, so the consumer polls NIXL
notifications fast for a while (``sc.NUDGE``). Nothing may depend on a nudge."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
zmq = pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import ConfigError, TransferReady, uniform_ranks  # noqa: E402
from pushkv.transports.inmemory import region_memory  # noqa: E402
from pushkv.transports.nixl import NixlConfig, NixlRuntime  # noqa: E402
from pushkv.transports.nixl.sidechannel.channel import NUDGE  # noqa: E402
from pushkv.transports.nixl.testing import wait_for_event  # noqa: E402
from pushkv.vllm.testing import poll  # noqa: E402

pytestmark = pytest.mark.nixl


def _pair(p_config: NixlConfig | None = None, c_config: NixlConfig | None = None
          ) -> tuple[NixlRuntime, NixlRuntime, list[np.ndarray], list[np.ndarray]]:
    p_info, c_info = uniform_ranks("prefill-0")[0], uniform_ranks("decode-0")[0]
    src = region_memory(p_info.layout, rng=np.random.default_rng(5))
    dst = region_memory(c_info.layout)
    prod = NixlRuntime(p_info, src, role="producer", config=p_config)
    cons = NixlRuntime(c_info, dst, role="consumer", config=c_config)
    return prod, cons, src, dst


@pytest.fixture
def runtimes() -> Iterator[list[NixlRuntime]]:
    made: list[NixlRuntime] = []
    yield made
    for rt in made:
        rt.close()



def _transfer(prod: NixlRuntime, cons: NixlRuntime, tid: str) -> None:
    cons.register(tid, "prefill-0", [5, 6], 20)
    prod.prefill_finished(tid, [1, 2], 20)
    assert wait_for_event(cons, "TransferReady", tid, 20.0) == TransferReady(
        transfer_id=tid, attempt=0)


def _stat(rt: NixlRuntime, key: str, done, timeout_s: float = 20.0) -> int:  # type: ignore[no-untyped-def]
    """The runtime's counter ``key`` once ``done(value)`` holds (or at the deadline)."""
    return int(poll(lambda: rt.stats().get(key, 0), done, timeout_s, interval_s=0.01))


def test_every_write_nudges_its_consumer(runtimes: list[NixlRuntime]) -> None:
    prod, cons, src, dst = _pair()
    runtimes += [prod, cons]
    cons.connect("prefill-0", [prod.address])
    for i in range(3):
        _transfer(prod, cons, f"t{i}")
    assert _stat(cons, "nudges", lambda n: n == 3) == 3
    tb = src[0].size // 64
    assert np.array_equal(dst[0][5 * tb:6 * tb], src[0][1 * tb:2 * tb])  # the full block


def test_no_nudge_window_means_no_nudge_sent(runtimes: list[NixlRuntime]) -> None:
    off = NixlConfig(nudge_window_s=0)
    prod, cons, _, _ = _pair(p_config=off)
    runtimes += [prod, cons]
    cons.connect("prefill-0", [prod.address])
    _transfer(prod, cons, "t")
    # a control frame sent after the write arrives after anything the write sent
    cons.register("u", "prefill-0", [9], 4)
    assert _stat(prod, "control_frames", lambda n: n >= 2) >= 2
    prod.prefill_finished("u", [3], 4)
    assert _stat(cons, "notifications", lambda n: n >= 2) >= 2
    assert cons.stats().get("nudges", 0) == 0


def test_forged_nudges_change_nothing_but_the_poll_rate(runtimes: list[NixlRuntime]) -> None:
    prod, cons, src, dst = _pair()
    runtimes += [prod, cons]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.connect(cons.address)
        for _ in range(50):
            sock.send_multipart([NUDGE, b""])
        sock.send_multipart([NUDGE, b"with a body"])
        assert _stat(cons, "nudges", lambda n: n == 51) == 51
        assert cons.poll() == []  # no event
        view = cons.inspect()
        assert view.transfers == 0 and view.lent == {} and view.stats.get("rejected", 0) == 0
    finally:
        sock.close(0)
    cons.connect("prefill-0", [prod.address])
    _transfer(prod, cons, "t")  # still works, bytes exact
    tb = src[0].size // 64
    assert np.array_equal(dst[0][5 * tb:6 * tb], src[0][1 * tb:2 * tb])  # the full block


@pytest.mark.parametrize("bad", [{"nudge_window_s": -1.0}, {"nudge_poll_s": 0.0},
                                 {"nudge_poll_s": float("nan")}])
def test_bad_nudge_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="nudge"):
        NixlConfig(**bad)
