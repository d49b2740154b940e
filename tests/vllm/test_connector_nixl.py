"""Both halves of PushKVConnector, on both roles, in one process, over real NIXL.

Two real vLLM Schedulers (a prefill and a decode engine) drive four real
``PushKVConnector`` instances -- each engine's scheduler half and worker half --
whose worker halves own CPU KV tensors laid out as vLLM's CPU backend lays
them out and move them with NIXL over UCX. Only the model is missing: the
prefill engine's KV is filled with seeded random bytes, and every test checks
that the blocks which landed on the decode engine equal the prefill engine's,
page for page, and that no block is left held on either side.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pushkv.vllm.config import ConnectorConfigError
from pushkv.vllm.connector import PushKVConnector
from pushkv.vllm.params import DecodeLeg, Endpoint, PrefillLeg
from pushkv.vllm.testing import free_port

from .harness import LAYERS, Engine, fresh_free, kv_cache_config, vllm_config

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.nixl,
]

BS = 32
BLOCKS = 64
DEADLINE_S = 20.0


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    """A one-process 'TP 1, PP 1' world, as every vLLM worker has."""
    if not model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)


@dataclass
class Side:
    """One engine: the Scheduler (with the scheduler half) and the worker half."""

    engine: Engine
    worker: PushKVConnector
    kv: dict[str, torch.Tensor]

    def run_workers(self, out: SchedulerOutput) -> KVConnectorOutput:
        w = self.worker
        # As vLLM's model runner: the forward, then start_load_kv, wait_for_save,
        # the transfer results.
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        w.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=results.finished_sending,
                                 finished_recving=results.finished_recving,
                                 failed_recving=results.failed_recving)

    def step(self) -> None:
        self.engine.step(self.run_workers)

    def page(self, block: int) -> torch.Tensor:
        return torch.stack([self.kv[name][block] for name in LAYERS])


def make_side(tiny_model, role: str, engine_id: str, port: int, seed: int | None,
              **kw) -> Side:
    extra = {"side_channel_port": port, "lease_s": 3.0, "heartbeat_s": 0.5,
             "window_s": 3.0, "fence_grace_s": 1.0, "handshake_timeout_s": 5.0}
    extra |= kw.pop("extra", {})
    cfg = vllm_config(tiny_model, role, engine_id=engine_id, num_blocks=BLOCKS, extra=extra,
                      **kw)
    engine = Engine(cfg)
    with set_current_vllm_config(cfg):
        worker = PushKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(BLOCKS, BS))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    kv = {}
    for name in LAYERS:
        t = torch.zeros(BLOCKS, 1, BS, 128, dtype=torch.float32)  # the CPU cache's shape
        if gen is not None:
            t.normal_(generator=gen)
        kv[name] = t
    worker.register_kv_caches(kv)
    return Side(engine, worker, kv)


_pairs = itertools.count()


@pytest.fixture
def pair(tiny_model):
    made: list[Side] = []

    def make(policy: str = "fail", **kw) -> tuple[Side, Side]:
        n = next(_pairs)  # default settings: each rank binds a free port
        p = make_side(tiny_model, "kv_producer", f"prefill-{n}", 0, seed=n + 1, **kw)
        d = make_side(tiny_model, "kv_consumer", f"decode-{n}", 0, seed=None,
                      policy=policy, **kw)
        made.extend((p, d))
        return p, d

    yield make
    for side in made:
        side.worker.shutdown()


def endpoint(p: Side) -> Endpoint:
    return p.worker.endpoint


def run(sides: tuple[Side, ...], done: Callable[[], bool], deadline_s: float = DEADLINE_S
        ) -> None:
    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            raise AssertionError("not done in time")
        for s in sides:
            s.step()
        time.sleep(0.002)


def idle(side: Side) -> bool:
    return side.engine.held() == set() and side.engine.free_blocks == fresh_free(side.engine)


def push(p: Side, d: Side, tid: str, n: int, max_tokens: int = 2, first: int = 10,
         incarnation: int = 0, suffix: str = ""):
    pr = p.engine.request(n, params=PrefillLeg(transfer_id=tid, incarnation=incarnation)
                          .to_params(), max_tokens=1, first=first, req_id=f"p-{tid}{suffix}")
    dr = d.engine.request(n, params=DecodeLeg(transfer_id=tid, producer=endpoint(p),
                                              incarnation=incarnation).to_params(),
                          max_tokens=max_tokens, first=first, req_id=f"d-{tid}{suffix}")
    return pr, dr


def test_pushed_pages_equal_the_prefill_pages(pair):
    p, d = pair()
    reqs = [push(p, d, f"t{i}", n, first=100 * i) for i, n in enumerate((5, 32, 33, 100, 160))]
    src = {}
    run((p, d), lambda: all(pr.request_id in p.engine.outputs.finish for pr, _ in reqs))
    for pr, _ in reqs:
        src[pr.request_id] = p.engine.blocks_of(pr.request_id)  # held for the push
    dst = {}

    def received() -> bool:
        for _, dr in reqs:
            if dr.request_id not in dst and dr.status == RequestStatus.RUNNING:
                dst[dr.request_id] = d.engine.blocks_of(dr.request_id)
        return all(dr.request_id in d.engine.outputs.finish for _, dr in reqs)

    run((p, d), received)
    for pr, dr in reqs:
        s_blocks, d_blocks = src[pr.request_id], dst[dr.request_id]
        assert len(s_blocks) == len(d_blocks) == -(-pr.num_prompt_tokens // BS)
        for sb, db in zip(s_blocks, d_blocks, strict=True):
            assert torch.equal(d.page(db), p.page(sb)), (pr.request_id, sb, db)
        assert d.engine.outputs.finish[dr.request_id] == "length"
    run((p, d), lambda: idle(p) and idle(d))
    assert p.engine.connector.scheduler_side.sends_held() == {}


def test_registration_first_or_prefill_first_land_alike(pair):
    p, d = pair()
    # decode registers long before the prefill even exists...
    dr = d.engine.request(70, params=DecodeLeg(transfer_id="late-p", producer=endpoint(p))
                          .to_params(), max_tokens=1, first=3, req_id="d-late-p")
    run((p, d), lambda: dr.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    for _ in range(20):
        d.step()
    pr = p.engine.request(70, params=PrefillLeg(transfer_id="late-p").to_params(),
                          max_tokens=1, first=3, req_id="p-late-p")
    # ...and a prefill finishes long before its decode request arrives.
    pr2 = p.engine.request(40, params=PrefillLeg(transfer_id="late-d").to_params(),
                           max_tokens=1, first=7, req_id="p-late-d")
    run((p,), lambda: pr2.request_id in p.engine.outputs.finish)
    for _ in range(20):
        p.step()
    dr2 = d.engine.request(40, params=DecodeLeg(transfer_id="late-d", producer=endpoint(p))
                           .to_params(), max_tokens=1, first=7, req_id="d-late-d")
    run((p, d), lambda: {dr.request_id, dr2.request_id} <= set(d.engine.outputs.finish))
    assert {d.engine.outputs.finish[r] for r in (dr.request_id, dr2.request_id)} == {"length"}
    run((p, d), lambda: idle(p) and idle(d))
    assert pr.request_id in p.engine.outputs.finish


def test_decode_abort_while_waiting_is_fenced_and_releases_both_sides(pair):
    p, d = pair()
    dr = d.engine.request(64, params=DecodeLeg(transfer_id="gone", producer=endpoint(p))
                          .to_params(), req_id="d-gone")
    run((p, d), lambda: dr.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
    d.engine.abort(dr.request_id)
    run((p, d), lambda: idle(d))  # the fence came back: blocks reusable
    pr = p.engine.request(64, params=PrefillLeg(transfer_id="gone").to_params(),
                          max_tokens=1, req_id="p-gone")
    run((p, d), lambda: pr.request_id in p.engine.outputs.finish and idle(p))  # released at once


def test_prefill_abort_fails_the_decode_request(pair, caplog):
    p, d = pair(policy="fail")
    pr, dr = push(p, d, "cut", 200)
    with caplog.at_level(logging.WARNING, logger="pushkv.vllm.worker_side"):
        p.engine.abort(pr.request_id)
        run((p, d), lambda: dr.request_id in d.engine.outputs.finish)
    assert d.engine.outputs.finish[dr.request_id] == "error"
    # one structured line for the failed transfer: its id, attempt and reason
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("pushkv transfer failed ")]
    assert len(lines) == 1, lines
    fields = json.loads(lines[0].removeprefix("pushkv transfer failed "))
    assert fields["transfer_id"] == "cut"
    assert fields["request_id"] == dr.request_id
    assert fields["reason"] == "PREFILL_ABORTED" and fields["attempt"] == 0
    assert fields["engine_id"].startswith("decode-") and fields["policy"] == "fail"
    run((p, d), lambda: idle(p) and idle(d))


def test_prefill_abort_under_recompute_prefills_on_decode(pair):
    p, d = pair(policy="recompute")
    pr, dr = push(p, d, "redo", 100, max_tokens=3)
    p.engine.abort(pr.request_id)
    run((p, d), lambda: dr.request_id in d.engine.outputs.finish)
    assert d.engine.outputs.finish[dr.request_id] == "length"
    assert len(d.engine.outputs.tokens[dr.request_id]) == 3
    run((p, d), lambda: idle(p) and idle(d))


def test_unclaimed_prefill_is_released_when_its_lease_expires(pair):
    p, _ = pair()
    pr = p.engine.request(50, params=PrefillLeg(transfer_id="orphan").to_params(),
                          max_tokens=1)
    run((p,), lambda: pr.request_id in p.engine.outputs.finish)
    t0 = time.monotonic()
    run((p,), lambda: idle(p), deadline_s=10)
    assert time.monotonic() - t0 > 2.0  # held for (most of) the 3 s lease first


def test_unreachable_producer_fails_after_the_handshake_timeout(tiny_model):
    d = make_side(tiny_model, "kv_consumer", "decode-lonely", free_port(), seed=None,
                  extra={"handshake_timeout_s": 1.0})
    try:
        nowhere = Endpoint(engine_id="prefill-nowhere", host="127.0.0.1", port=free_port())
        dr = d.engine.request(40, params=DecodeLeg(transfer_id="x", producer=nowhere)
                              .to_params(), req_id="d-x")
        run((d,), lambda: dr.request_id in d.engine.outputs.finish, deadline_s=15)
        assert d.engine.outputs.finish[dr.request_id] == "error"
        run((d,), lambda: idle(d))
    finally:
        d.worker.shutdown()


def test_two_instances_with_default_settings_bind_their_own_ports(pair):
    p, d = pair()
    (p_addr,), (d_addr,) = p.worker.endpoint.ranks, d.worker.endpoint.ranks
    assert p_addr != d_addr and p_addr.startswith("tcp://127.0.0.1:")
    assert p.worker.endpoint.addresses() == {0: p_addr}


def test_a_taken_port_stops_start_up_with_one_line_naming_the_setting(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConnectorConfigError) as info:
            make_side(tiny_model, "kv_producer", "prefill-taken", port, seed=None)
    message = str(info.value)
    assert "\n" not in message and f"side_channel_port={port}" in message, message


def test_a_decode_request_ended_before_registering_releases_the_producer_at_once(pair):
    p, d = pair(extra={"lease_s": 120.0})
    pr, dr = push(p, d, "warm", 40)  # the consumer has handshaken with the producer
    run((p, d), lambda: dr.request_id in d.engine.outputs.finish)
    run((p, d), lambda: idle(p) and idle(d))
    pr = p.engine.request(50, params=PrefillLeg(transfer_id="quit", incarnation=7).to_params(),
                          max_tokens=1, first=70, req_id="p-quit")
    run((p,), lambda: pr.request_id in p.engine.outputs.finish)
    assert not idle(p)  # its KV is held for the transfer
    dr = d.engine.request(50, params=DecodeLeg(transfer_id="quit", producer=endpoint(p),
                                               incarnation=7).to_params(), first=70)
    d.engine.abort(dr.request_id)  # still queued: nothing was registered
    run((p, d), lambda: idle(p) and idle(d), deadline_s=20)  # far less than the 120 s lease
    assert d.engine.orders("recv") and len(d.engine.orders("recv_abandon")) == 1


def test_a_reused_transfer_id_with_a_new_incarnation_is_a_new_transfer(pair):
    p, d = pair()
    for n, incarnation in ((40, 11), (70, 12)):
        _, dr = push(p, d, "again", n, first=n, incarnation=incarnation,
                      suffix=f"-{incarnation}")
        run((p, d), lambda dr=dr: dr.request_id in d.engine.outputs.finish)
        assert d.engine.outputs.finish[dr.request_id] == "length"
        run((p, d), lambda: idle(p) and idle(d))


def test_descriptors_per_transfer_are_reported_once_the_source_is_released(pair):
    """Each push's NIXL descriptors reach the producer's stats as one observation,
    equal to what its writer posted."""
    p, d = pair()
    reqs = [push(p, d, f"desc{i}", n, first=50 * i) for i, n in enumerate((20, 64, 130))]
    run((p, d), lambda: all(dr.request_id in d.engine.outputs.finish for _, dr in reqs))
    run((p, d), lambda: idle(p) and idle(d))
    rt = p.worker.worker_side.runtime
    assert rt is not None
    posted: dict[str, int] = {}
    for w in rt.inspect().recent_writes:
        posted[w.transfer_id] = posted.get(w.transfer_id, 0) + w.descriptors
    stats = p.worker.get_kv_connector_stats()
    assert stats is not None
    got = sorted(stats.data["descriptors_per_transfer"])
    assert got == sorted(posted[f"desc{i}"] for i in range(3)), (got, posted)
    assert all(n > 0 for n in got)


def test_a_pushed_source_is_held_until_the_decode_engines_first_step(pair):
    """Rule 12 with ``retarget_hold_s``: the prefill keeps its blocks after the write
    (for a re-target) until the decode engine's first step of the request tells it
    (``Consumed``); that, not the hold, frees them."""
    p, d = pair(extra={"retarget_hold_s": 300.0})
    _, dr = push(p, d, "held", 70, max_tokens=3)
    run((p, d), lambda: dr.status == RequestStatus.RUNNING)  # its first decode step
    run((p, d), lambda: idle(p) and idle(d))  # well before the hold ends
    assert d.engine.outputs.finish[dr.request_id] == "length"
    rt = p.worker.worker_side.runtime
    assert rt is not None
    stats = rt.inspect().endpoint_stats
    assert (stats["lingered"], stats["consumed"]) == (1, 1), stats
    assert d.engine.orders("consumed") == ["held"]
