"""``PushKVConnector``: pushkv as a vLLM v1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "PushKVConnector",
                           "kv_connector_module_path": "pushkv.vllm.connector",
                           "kv_role": "kv_producer",   # or "kv_consumer"
                           "kv_connector_extra_config": {...}}'

vLLM builds the class twice: once in the engine-core process with the
SCHEDULER role and once per worker with the WORKER role. The scheduler half
(:mod:`.scheduler_side`) decides from vLLM's requests and blocks; the worker
half (:mod:`.worker_side`) owns the KV memory and the transport. They speak
through each step's :class:`~.metadata.PushKVMetadata` (scheduler -> workers)
and vLLM's finished/failed request sets (workers -> scheduler).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .. import timeline
from .config import ConnectorConfigError, PushKVSettings, failure_policy
from .metadata import PushKVMetadata, RankAddress
from .params import Endpoint, with_ranks
from .scheduler_side import SchedulerSide
from .stats import PushKVPromMetrics, PushKVStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .worker_side import WorkerSide

logger = logging.getLogger(__name__)

__all__ = ["PushKVConnector"]


class PushKVConnector(KVConnectorBase_V1):
    """Push-mode P/D KV transfer: the decode side registers its blocks as soon as
    vLLM allocates them, the prefill side writes into them from a background
    thread once its prefill finished, in whichever order the two happen."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = PushKVSettings.from_extra_config(ktc.kv_connector_extra_config)
        self.policy = failure_policy(ktc.kv_load_failure_policy)
        if ktc.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ConnectorConfigError(
                f"kv_role must be kv_producer, kv_consumer or kv_both, got {ktc.kv_role!r}"
            )
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) > 1:
            raise ConnectorConfigError(
                f"PushKVConnector needs a single KV cache group, this model has {len(groups)}"
                " (run with --disable-hybrid-kv-cache-manager)"
            )
        if ktc.engine_id is None:  # vLLM fills it in; a bare config in tests may not
            raise ConnectorConfigError("kv_transfer_config.engine_id is not set")
        self.engine_id: str = ktc.engine_id
        self.block_size: int = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self.endpoint = Endpoint(
            engine_id=self.engine_id,
            host=self.settings.side_channel_host,
            port=self.settings.side_channel_port,
            role="producer" if ktc.is_kv_producer else "consumer",
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            block_size=self.block_size,
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._idle_step = False  # this step runs no forward (set by start_load_kv)
        if self.settings.timeline_dir:  # empty: leave the process's recorder as it is
            timeline.configure(self.settings.timeline_dir,
                               f"{self.engine_id}-{role.name.lower()}")
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                endpoint=self.endpoint, block_size=self.block_size,
                is_producer=ktc.is_kv_producer, is_consumer=ktc.is_kv_consumer,
                policy=self.policy.value, key=self.settings.load_key(),
                direction=self.settings.direction,
                granularity=self.settings.push_granularity,
                vocab_size=_vocab_size(vllm_config),
                lease_s=self.settings.lease_s, integrity=self.settings.integrity,
            )
        else:
            from .worker_side import WorkerSide  # the transport is needed here only

            self._worker = WorkerSide.from_vllm(
                vllm_config, settings=self.settings, policy=self.policy,
                engine_id=self.engine_id, is_producer=ktc.is_kv_producer,
                is_consumer=ktc.is_kv_consumer,
            )

    # ------------------------------------------------------------ helpers

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker connector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side method called on the scheduler connector")
        return self._worker

    # ========================================================== scheduler

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    # ============================================================= worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)
        mine = self.worker_side.handshake()
        if mine is not None and self.endpoint.world_size == 1:
            self.endpoint = with_ranks(self.endpoint, {0: mine.address})

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This rank's side-channel address, gathered by vLLM for the scheduler."""
        return self._worker.handshake() if self._worker is not None else None

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every rank's side-channel address: what discovery answers advertise."""
        if self._scheduler is None:
            return
        ranks = {m.rank: m.address for m in metadata.values() if isinstance(m, RankAddress)}
        if len(ranks) != self.endpoint.world_size:
            raise ConnectorConfigError(
                f"pushkv: {len(ranks)} of {self.endpoint.world_size} ranks reported their "
                "side-channel address")
        self.endpoint = with_ranks(self.endpoint, ranks)
        self._scheduler.endpoint = self.endpoint
        logger.info("pushkv %s: side channel %s", self.engine_id, list(self.endpoint.ranks))

    def set_xfer_handshake_metadata(
            self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # vLLM's kv_connector_no_forward sets no attention metadata: a step with nothing
        # to compute, which may wait for the pulls being read (WorkerSide.results)
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        meta = self._connector_metadata
        if isinstance(meta, PushKVMetadata):
            self.worker_side.apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """push_granularity 'layer': this step's prompt KV of the layer is final."""
        meta = self._connector_metadata
        if isinstance(meta, PushKVMetadata) and meta.send_ranges:
            self.worker_side.layer_saved(meta.send_ranges, layer_name)

    def wait_for_save(self) -> None:
        """The step's forward is done: push_granularity 'chunk' reports this step's
        prompt KV final in every layer, and prefills this step ends are finished."""
        meta = self._connector_metadata
        if isinstance(meta, PushKVMetadata):
            if meta.send_ranges:
                self.worker_side.step_saved(meta.send_ranges)
            if meta.send_at_save:
                self.worker_side.finish_saved(meta.send_at_save)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        idle, self._idle_step = self._idle_step, False
        sending, recving, failed = self.worker_side.results(idle)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failures are reported per request (failed_recving)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            # The scheduler asks last in vLLM's handling of a step's output (after
            # request_finished and update_connector_output): the step's answers are done.
            self.scheduler_side.step_output_done()
            return None
        return self._worker.take_stats()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The seals of the sources this step published for a pull (rule 11), for the
        scheduler side to add to their answers."""
        return self.worker_side.published_seals()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return PushKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PushKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


def _vocab_size(vllm_config: VllmConfig) -> int:
    """The served model's vocabulary size (0 where it cannot be told), for the proxy's
    check of token ids: vLLM skips that check when it has no tokenizer, and an id past
    the embedding crashes the engine."""
    try:
        return max(int(vllm_config.model_config.get_vocab_size()), 0)
    except Exception:  # a config without a model (tests) or an odd one: not known
        return 0
