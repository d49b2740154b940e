"""NixlRuntime in one process: engine-thread API, hand-off cost, shutdown."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import ConfigError, TransferReady, uniform_ranks
from pushkv.transports.inmemory import region_memory
from pushkv.transports.nixl import CallFailed, NixlConfig, NixlRuntime
from pushkv.transports.nixl.sidechannel.channel import SideChannelBindError

pytestmark = pytest.mark.nixl


@pytest.fixture
def pair() -> Iterator[tuple[NixlRuntime, NixlRuntime, list[np.ndarray], list[np.ndarray]]]:
    p_info, c_info = uniform_ranks("prefill-0")[0], uniform_ranks("decode-0")[0]
    src = region_memory(p_info.layout, rng=np.random.default_rng(3))
    dst = region_memory(c_info.layout)
    prod = NixlRuntime(p_info, src, role="producer")
    cons = NixlRuntime(c_info, dst, role="consumer")
    try:
        yield prod, cons, src, dst
    finally:
        prod.close()
        cons.close()


def _until(rt: NixlRuntime, pred: type, timeout_s: float = 10.0) -> list[object]:
    seen: list[object] = []
    end = time.monotonic() + timeout_s
    while not any(isinstance(e, pred) for e in seen) and time.monotonic() < end:
        rt.wait(0.05)
        seen += rt.poll()
    return seen


def test_transfer_in_one_process_and_clean_close(pair) -> None:  # type: ignore[no-untyped-def]
    prod, cons, src, dst = pair
    cons.connect("prefill-0", [prod.address])
    cons.register("t", "prefill-0", [5, 6], 20)
    prod.prefill_finished("t", [1, 2], 20)
    events = _until(cons, TransferReady)
    assert TransferReady(transfer_id="t", attempt=0) in events
    tb = src[0].size // 64  # bytes per block
    assert np.array_equal(dst[0][5 * tb:6 * tb], src[0][1 * tb:2 * tb])
    prod.close()
    cons.close()
    assert prod.closed and cons.closed
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pushkv-")]
    with pytest.raises(RuntimeError, match="closed"):
        prod.prefill_finished("u", [1], 4)


def test_engine_calls_are_hand_offs(pair) -> None:  # type: ignore[no-untyped-def]
    """An engine-thread call costs microseconds whatever the I/O thread does."""
    prod, _, _, _ = pair
    costs = []
    for i in range(300):
        t0 = time.perf_counter()
        prod.prefill_finished(f"r{i}", [i % 64], 16)
        costs.append(time.perf_counter() - t0)
    assert statistics.median(costs) < 200e-6, statistics.median(costs)


def test_misuse_comes_back_as_call_failed(pair) -> None:  # type: ignore[no-untyped-def]
    prod, cons, _, _ = pair
    cons.register("t", "nobody", [1], 4)  # no connect() for this engine
    prod.register("t", "x", [1], 4)  # a producer cannot register
    failed = _until(cons, CallFailed) + _until(prod, CallFailed)
    ops = sorted(e.operation for e in failed if isinstance(e, CallFailed))
    assert ops == ["register", "register"], failed


def test_memory_too_small_fails_before_any_agent() -> None:
    info = uniform_ranks("e")[0]
    small = [np.zeros(8, np.uint8)] * info.layout.num_regions
    with pytest.raises(ConfigError):
        NixlRuntime(info, small, role="producer")


def test_idle_runtimes_do_not_spin(pair) -> None:  # type: ignore[no-untyped-def]
    """Two connected runtimes with nothing to do use next to no CPU."""
    prod, cons, _, _ = pair
    cons.connect("prefill-0", [prod.address], eager=True)
    end = time.monotonic() + 10
    while not cons.connected("prefill-0") and time.monotonic() < end:
        cons.wait(0.01)
    assert cons.connected("prefill-0")
    cpu0, wall0 = time.process_time(), time.monotonic()
    threading.Event().wait(1.0)  # idle on purpose: this measures idle CPU
    cores = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert cores < 0.15, f"idle runtimes use {cores:.2f} cores"


def test_ranks_on_one_host_bind_free_ports_by_default(pair) -> None:  # type: ignore[no-untyped-def]
    """Default settings: every runtime binds its own free port and says which."""
    prod, cons, _, _ = pair
    assert prod.port != cons.port and prod.port > 0 and cons.port > 0
    assert prod.address == f"tcp://127.0.0.1:{prod.port}"
    assert cons.address == f"tcp://127.0.0.1:{cons.port}"


def test_a_taken_port_fails_at_start_naming_the_setting(pair) -> None:  # type: ignore[no-untyped-def]
    prod, _, _, _ = pair
    info = uniform_ranks("decode-1")[0]
    with pytest.raises(SideChannelBindError) as err:
        NixlRuntime(info, region_memory(info.layout), role="consumer",
                    config=NixlConfig(port=prod.port))
    line = str(err.value)
    assert "\n" not in line and "address already in use" in line, line
    assert "setting: port" in line and str(prod.port) in line, line
    assert err.value.setting == "port" and isinstance(err.value, ConfigError)
    with pytest.raises(SideChannelBindError, match="setting: host"):
        NixlRuntime(info, region_memory(info.layout), role="consumer",
                    config=NixlConfig(host="192.0.2.1"))  # not an address of this host


def test_bind_every_interface_and_advertise_one() -> None:
    with pytest.raises(ConfigError, match="advertise_host"):
        NixlConfig(host="0.0.0.0")
    info = uniform_ranks("decode-2")[0]
    rt = NixlRuntime(info, region_memory(info.layout), role="consumer",
                     config=NixlConfig(host="0.0.0.0", advertise_host="127.0.0.1"))
    try:
        assert rt.address == f"tcp://127.0.0.1:{rt.port}"
    finally:
        rt.close()



def test_a_host_memory_consumer_runs_no_progress_thread(pair) -> None:  # type: ignore[no-untyped-def]
    """Nothing of a decode rank wakes while idle: on host memory its I/O thread
    progresses NIXL while transfers are live, so no progress thread is asked for
    (one is, on request); transfers still land (the rest of this file)."""
    prod, cons, _, _ = pair
    assert cons.progress_thread is False and prod.progress_thread is False
    info = uniform_ranks("decode-threads")[0]
    rt = NixlRuntime(info, region_memory(info.layout), role="consumer",
                     config=NixlConfig(progress_thread=True))
    try:
        assert rt.progress_thread is True
    finally:
        rt.close()
