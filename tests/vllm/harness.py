"""Drive vLLM's real v1 ``Scheduler`` with ``PushKVConnector``, without a model.

:class:`Engine` wraps one Scheduler (built exactly as vLLM's engine core
builds it, with the connector loaded through ``kv_connector_module_path``) and
plays the part of the model runner: each :meth:`Engine.step` schedules, hands
the step's connector metadata to the test (or to real worker connectors), and
feeds back one sampled token per scheduled request together with whatever the
workers reported.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from pushkv.vllm.connector import PushKVConnector
from pushkv.vllm.metadata import PushKVMetadata

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
EOS = 2

_hash_ready = False


def vllm_config(model: Path, role: str, *, block_size: int = 32, num_blocks: int = 64,
                policy: str = "fail", extra: dict[str, Any] | None = None,
                engine_id: str | None = None, max_num_seqs: int = 16) -> VllmConfig:
    cfg = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32",
                                 seed=0, max_model_len=256),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=256,
            enable_chunked_prefill=True, is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PushKVConnector", kv_connector_module_path="pushkv.vllm.connector",
            kv_role=role, kv_load_failure_policy=policy, engine_id=engine_id,
            kv_connector_extra_config=dict(extra or {})),
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


@dataclass
class Outputs:
    """What the engine returned to clients so far, by request id."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    params: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def add(self, out: EngineCoreOutput) -> None:
        self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish[out.request_id] = str(out.finish_reason)
            self.params[out.request_id] = out.kv_transfer_params


#: A model runner stand-in: scheduler output -> the workers' connector output.
Workers = Callable[[SchedulerOutput], KVConnectorOutput | None]


class Engine:
    """One vLLM Scheduler with PushKVConnector, stepped by hand."""

    def __init__(self, cfg: VllmConfig) -> None:
        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        self.cfg = cfg
        self.block_size = cfg.cache_config.block_size
        self.num_blocks = cfg.cache_config.num_gpu_blocks
        assert self.num_blocks is not None
        self.sched = Scheduler(vllm_config=cfg,
                               kv_cache_config=kv_cache_config(self.num_blocks, self.block_size),
                               structured_output_manager=StructuredOutputManager(cfg),
                               block_size=self.block_size, log_stats=True)
        assert isinstance(self.sched.connector, PushKVConnector)
        self.connector: PushKVConnector = self.sched.connector
        self.outputs = Outputs()
        self.metas: list[PushKVMetadata] = []
        self._ids = itertools.count()

    # ----------------------------------------------------------- requests

    def request(self, num_tokens: int, *, max_tokens: int = 4, params: Any = None,
                req_id: str | None = None, first: int = 10) -> Request:
        rid = req_id or f"req-{next(self._ids)}"
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                            extra_args={"kv_transfer_params": params} if params else None)
        sp.update_from_generation_config({}, EOS)
        prompt = [(first + 7 * i) % 990 + 5 for i in range(num_tokens)]
        req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                      pooling_params=None,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.sched.add_request(req)
        return req

    def abort(self, *req_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    # -------------------------------------------------------------- steps

    def step(self, workers: Workers | None = None,
             kv: KVConnectorOutput | None = None) -> SchedulerOutput:
        """One engine step; the connector output comes from ``workers`` or ``kv``."""
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, PushKVMetadata)
        self.metas.append(meta)
        if workers is not None:
            kv = workers(out)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # advanced by schedule()
            sampled.append([100 + len(req.output_token_ids)] if done else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kv)
        for eco in self.sched.update_from_output(out, mro).values():
            for o in eco.outputs:
                self.outputs.add(o)
        return out

    def run(self, steps: int, workers: Workers | None = None) -> None:
        for _ in range(steps):
            self.step(workers)

    def run_until(self, done: Callable[[], bool], workers: Workers | None = None,
                  max_steps: int = 200) -> int:
        for n in range(max_steps):
            if done():
                return n
            self.step(workers)
        raise AssertionError(f"not done after {max_steps} steps")

    # -------------------------------------------------------------- state

    @property
    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def held(self) -> set[str]:
        """Requests the scheduler still tracks (running, waiting or delay-freed)."""
        return set(self.sched.requests)

    def orders(self, kind: str) -> list[Any]:
        return [o for m in self.metas for o in getattr(m, kind)]

    def finished_prefills(self) -> list[Any]:
        """Every prefill handed over as finished: at a step's start (``send``) or as the
        step that ends a one-token prefill leg saved its KV (``send_at_save``)."""
        return self.orders("send") + self.orders("send_at_save")


def fresh_free(engine: Engine) -> int:
    """Free blocks of an idle engine (all but the null block)."""
    return engine.num_blocks - 1


def ids(items: Iterable[Any]) -> list[str]:
    return [getattr(i, "req_id", i) for i in items]
