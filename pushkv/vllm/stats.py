"""Transfer counters of ``PushKVConnector``: vLLM's log line and Prometheus counters.

Workers count what happened since the last step (:class:`PushKVStats`); vLLM
sums the workers' counts, logs them ("KV Transfer metrics: ...") and feeds
them to :class:`PushKVPromMetrics`, which exposes one ``pushkv:<name>_total``
counter per field on the server's ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

#: Counter name -> help. Consumer counters first, then producer ones.
COUNTERS: dict[str, str] = {
    "transfers_registered": "registrations sent to producers",
    "transfers_ready": "transfers whose KV landed",
    "transfers_failed": "transfers that failed (the failure policy applied)",
    "transfers_cancelled": "transfers cancelled by an abort, after their fence",
    "blocks_received": "KV blocks that landed in this instance",
    "pushes_started": "prefills whose KV was handed to the transport",
    "pushes_aborted": "prefills that ended before their KV was complete",
    "sources_released": "prefilled KV released after its push, a cancel or a lease expiry",
    "blocks_sent": "KV blocks released after a completed push",
}


class PushKVStats(KVConnectorStats):
    """Counts since the previous report; sums across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, n: int = 1) -> None:
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, int | float):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PushKVPromMetrics(KVConnectorPromMetrics):
    """``pushkv:<counter>_total`` on ``/metrics``, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"pushkv:{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value:
                per_engine[engine_idx].inc(value)
