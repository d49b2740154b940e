"""Progressive push through both halves of PushKVConnector, over real NIXL.

As in ``test_connector_nixl``, two real vLLM Schedulers drive real connector
halves whose worker halves own CPU KV tensors and move them with NIXL over
UCX. The model is played by the test, as vLLM's model runner calls the
connector: each step binds the metadata, writes the KV of exactly the tokens
the step computes, layer by layer, calling ``save_kv_layer`` after each layer,
then ``start_load_kv``, ``wait_for_save`` and ``get_transfer_results``. After
every producer step the test waits until the producer's runtime has written
all it was given, so a range reported before its bytes were written would
land stale bytes on the decode side -- every test compares the pages.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from pushkv.vllm.params import DecodeLeg, PrefillLeg
from pushkv.vllm.stats import EARLY_BYTES, PushKVStats

from .harness import LAYERS, fresh_free
from .test_connector_nixl import Side, distributed, make_side  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.nixl,
]

BS = 32
DEADLINE_S = 20.0
#: Tokens a producer step computes (chunked prefill), not a multiple of the block.
BUDGET = 50


@dataclass
class Producer:
    """The prefill engine with a model stand-in that writes the KV it computes."""

    side: Side
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(7))
    stats: PushKVStats = field(default_factory=PushKVStats)

    def forward(self, out: SchedulerOutput) -> KVConnectorOutput:
        w, kv = self.side.worker, self.side.kv
        w.bind_connector_metadata(out.kv_connector_metadata)
        spans = []
        for new in out.scheduled_new_reqs:
            spans.append((new.req_id, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        spans += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for name in LAYERS:  # the KV of [computed, computed + scheduled), this layer
            for req_id, before in spans:
                blocks = self.side.engine.blocks_of(req_id)
                for t in range(before, before + out.num_scheduled_tokens[req_id]):
                    kv[name][blocks[t // BS], :, t % BS, :] = torch.randn(
                        kv[name].shape[1], kv[name].shape[3], generator=self.gen)
            w.save_kv_layer(name, kv[name], None)  # type: ignore[arg-type]
        w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        stats = w.get_kv_connector_stats()
        if stats is not None:
            self.stats.aggregate(stats)
        w.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=results.finished_sending,
                                 finished_recving=results.finished_recving,
                                 failed_recving=results.failed_recving)

    def step(self) -> None:
        self.side.engine.step(self.forward)
        rt = self.side.worker.worker_side.runtime
        assert rt is not None
        end = time.monotonic() + DEADLINE_S  # inspect() answers after the step's commands
        while rt.inspect().writes_in_flight:  # each inspect() waits for the I/O thread
            assert time.monotonic() < end, "writes did not complete"
            rt.wait(0.001)  # until an event is pending, at most a millisecond

    def counter(self, name: str) -> int:
        value = self.stats.data.get(name, 0)
        assert isinstance(value, int)
        return value


_pairs = itertools.count()


@pytest.fixture
def pair(tiny_model):
    made: list[Side] = []

    def make(granularity: str, policy: str = "fail") -> tuple[Producer, Side]:
        n = next(_pairs)
        p = make_side(tiny_model, "kv_producer", f"prefill-pg{n}", 0, seed=None,
                      extra={"push_granularity": granularity})
        p.engine.sched.max_num_scheduled_tokens = BUDGET
        d = make_side(tiny_model, "kv_consumer", f"decode-pg{n}", 0, seed=None,
                      policy=policy)
        made.extend((p, d))
        return Producer(p), d

    yield make
    for side in made:
        side.worker.shutdown()


def run(p: Producer, d: Side, done: Callable[[], bool], *, decode: bool = True) -> None:
    end = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, "not done in time"
        if decode:
            d.step()
        p.step()
        rt = d.worker.worker_side.runtime
        assert rt is not None
        rt.wait(0.002)  # the decode side's next event, or the next step


def idle(side: Side) -> bool:
    return side.engine.held() == set() and side.engine.free_blocks == fresh_free(side.engine)


def registered_first(p: Producer, d: Side, specs: list[tuple[str, int, int]]
                     ) -> list[tuple[Request, Request]]:
    """Decode legs of ``(transfer id, prompt length, salt)``; once the producer holds
    their registrations, the prefill legs."""
    drs = [decode_leg(p, d, tid, n, first) for tid, n, first in specs]
    rt = p.side.worker.worker_side.runtime
    assert rt is not None
    run(p, d, lambda: rt.inspect().transfers == len(specs))
    prs = [p.side.engine.request(n, params=PrefillLeg(transfer_id=tid).to_params(),
                                 max_tokens=1, first=first, req_id=f"p-{tid}")
           for tid, n, first in specs]
    return list(zip(prs, drs, strict=True))


def decode_leg(p: Producer, d: Side, tid: str, n: int, first: int) -> Request:
    return d.engine.request(n, params=DecodeLeg(transfer_id=tid, producer=p.side.worker.endpoint)
                            .to_params(), max_tokens=2, first=first, req_id=f"d-{tid}")


def landed_equal(p: Producer, d: Side, pairs: list[tuple[Request, Request]]) -> None:
    """Run until every decode request finished; the pages that landed equal the
    prefill's (both taken when they are final: blocks are reused afterwards)."""
    src: dict[str, list[torch.Tensor]] = {}
    dst: dict[str, list[torch.Tensor]] = {}

    def done() -> bool:
        for pr, dr in pairs:
            if pr.request_id in p.side.engine.outputs.finish and pr.request_id not in src:
                src[pr.request_id] = [p.side.page(b).clone()  # held for the push
                                      for b in p.side.engine.blocks_of(pr.request_id)]
            if dr.request_id not in dst and dr.status == RequestStatus.RUNNING:
                dst[dr.request_id] = [d.page(b).clone() for b in d.engine.blocks_of(dr.request_id)]
        return all(dr.request_id in d.engine.outputs.finish for _, dr in pairs)

    run(p, d, done)
    for pr, dr in pairs:
        assert d.engine.outputs.finish[dr.request_id] == "length"
        s_pages, d_pages = src[pr.request_id], dst[dr.request_id]
        assert len(s_pages) == len(d_pages) == -(-pr.num_prompt_tokens // BS)
        for i, (sp, dp) in enumerate(zip(s_pages, d_pages, strict=True)):
            assert torch.equal(dp, sp), (pr.request_id, i)
    run(p, d, lambda: idle(p.side) and idle(d))


@pytest.mark.parametrize("granularity", ["chunk", "layer"])
def test_streamed_pages_equal_the_prefill_pages_and_left_during_prefill(pair, granularity):
    p, d = pair(granularity)
    # The decode side registers first; the prefill then takes several steps.
    pairs = registered_first(p, d, [(f"s{i}-{granularity}", n, 100 * i)
                                    for i, n in enumerate((5, 33, 160, 230))])
    landed_equal(p, d, pairs)
    steps = sum(-(-n // BUDGET) for n in (5, 33, 160, 230))  # an upper bound, shared steps
    assert 0 < p.counter("ranges_reported") <= steps * (len(LAYERS) if granularity == "layer"
                                                        else 1)
    assert p.counter(EARLY_BYTES) > 0


def test_whole_request_push_writes_nothing_during_prefill(pair):
    p, d = pair("request")
    landed_equal(p, d, registered_first(p, d, [("whole", 230, 3)]))
    assert p.counter("ranges_reported") == 0
    assert p.counter(EARLY_BYTES) == 0


@pytest.mark.parametrize("granularity", ["chunk", "layer"])
def test_a_registration_after_some_ranges_still_gets_them(pair, granularity):
    p, d = pair(granularity)
    tid = f"late-{granularity}"
    pr = p.side.engine.request(230, params=PrefillLeg(transfer_id=tid).to_params(),
                               max_tokens=1, first=11, req_id=f"p-{tid}")
    for _ in range(2):  # two chunks computed and reported, nobody registered yet
        p.step()
    assert p.counter("ranges_reported") > 0 and pr.request_id not in p.side.engine.outputs.finish
    dr = decode_leg(p, d, tid, 230, first=11)
    landed_equal(p, d, [(pr, dr)])


@pytest.mark.parametrize("granularity", ["chunk", "layer"])
def test_prefill_aborted_mid_stream_fails_the_decode_request_and_frees_both(pair,
                                                                            granularity):
    p, d = pair(granularity)
    ((pr, dr),) = registered_first(p, d, [(f"cut-{granularity}", 230, 21)])
    for _ in range(3):  # 150 of 230 tokens computed, 128 reported and written
        d.step()
        p.step()
    assert p.counter(EARLY_BYTES) > 0 and pr.request_id not in p.side.engine.outputs.finish
    p.side.engine.abort(pr.request_id)
    run(p, d, lambda: dr.request_id in d.engine.outputs.finish)
    assert d.engine.outputs.finish[dr.request_id] == "error"
    run(p, d, lambda: idle(p.side) and idle(d))
