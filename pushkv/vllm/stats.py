"""Transfer metrics of ``PushKVConnector``: vLLM's log line and Prometheus metrics.

Workers record what happened since the last step (:class:`PushKVStats`):
counts, failures by reason (``failed_reason:<REASON>``), and observations for
histograms (lists of values). vLLM merges the workers' records, logs them
("KV Transfer metrics: ...", histograms as count and mean) and feeds them to
:class:`PushKVPromMetrics`, which exposes on the server's ``/metrics``:

* ``pushkv:<counter>_total`` for each of :data:`COUNTERS`;
* ``pushkv:transfers_failed_by_reason_total{reason}``;
* histograms ``pushkv:<name>`` for each of :data:`HISTOGRAMS`;
* gauges ``pushkv:<name>`` for each of :data:`GAUGES` (workers report changes).
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
    "transfers_registered": "registrations sent to producers (push)",
    "transfers_pulled": "transfers read from producers by the background reader (pull)",
    "transfers_ready": "transfers whose KV landed",
    "transfers_failed": "transfers that failed (the failure policy applied)",
    "transfers_cancelled": "transfers cancelled by an abort, after their fence",
    "transfers_abandoned": "requests that ended before registering: producer told to release",
    "transfers_consumed": "pushed transfers whose first decode step (or end) was reported to "
                          "their producer, which frees a source kept for a re-target",
    "blocks_received": "KV blocks that landed in this instance",
    "pushes_started": "prefills whose KV was handed to the transport to push",
    "sources_published": "prefills whose KV was published for the consumer to read (pull)",
    "pushes_aborted": "prefills that ended before their KV was complete",
    "seals_late": "pull: published sources whose seal (integrity) was not ready by the end "
                  "of the step that answered them: read unchecked; alert on any",
    "sources_released": "prefilled KV released after its push, a cancel or a lease expiry",
    "blocks_sent": "KV blocks released after a completed push",
    "ranges_reported": "progressive push: ranges of prefilled KV (tokens x layers) handed "
                       "to the transport before the prefill finished",
    "bytes_before_prefill_end": "progressive push: KV bytes whose write completed while "
                                "the prefill was still running (0 with push_granularity "
                                "'request')",
    "frames_refused": "side-channel frames dropped: failed authentication, replayed, stale "
                      "or malformed (the runtime's counts)",
    "writes_packed": "producer: writes gathered into staging memory and posted as a few "
                     "large descriptors (pack)",
    "writes_scattered": "consumer: packed writes scattered from staging memory into their "
                        "blocks",
    "runs_scattered": "consumer: contiguous destination runs (per layer and plane) those "
                      "scatters wrote; above writes_scattered when the cache is fragmented",
    "ranges_checked": "consumer: written ranges whose landed bytes were checked against the "
                      "producer's digest (integrity)",
    "ranges_corrupt": "consumer: checked ranges whose bytes differed: each failed its "
                      "transfer with CORRUPT (the failure policy applied); alert on any",
    "ranges_injected": "consumer: ranges corrupted on purpose by integrity_inject (tests and "
                       "chaos runs only; 0 in service)",
    "ranges_unchecked": "consumer: sealed ranges that could not be checked and were served "
                        "unchecked (a pull of the remainder after a cached prefix, or of some "
                        "of a producer rank's layers)",
}
#: Gauge name -> help. Workers report each as the change since their last report.
GAUGES: dict[str, str] = {
    "staging_bytes_lent": "staging memory lent to transfers whose writes may still land or "
                          "be scattered (0 when idle)",
}
#: The runtime's counters behind each counter or gauge kept in step with them.
FROM_RUNTIME = {"writes_packed": "writes_packed", "writes_scattered": "scatters_ok",
                "runs_scattered": "scatter_runs", "staging_bytes_lent": "staging_lent_bytes",
                "ranges_checked": "integrity_checked", "ranges_corrupt": "integrity_corrupt",
                "ranges_injected": "integrity_injected",
                "ranges_unchecked": "integrity_unchecked"}
#: Counter of the KV bytes written while the prefill ran (the runtime's
#: ``bytes_written_early``).
EARLY_BYTES = "bytes_before_prefill_end"
#: The runtime's counters that make up ``frames_refused``.
REFUSED_FRAMES = ("auth_failed", "auth_replayed", "auth_stale", "auth_unprotected", "rejected")


#: Histogram name -> (help, buckets).
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "registration_to_ready_seconds": (
        "consumer: from sending a registration to the KV having landed",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)),
    "transfer_seconds": (
        "producer: from the prefill's end to its KV released (pushed, or given up)",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30, 60)),
    "transfer_bytes": (
        "consumer: KV bytes that landed in this rank for one transfer",
        tuple(float(4**i * 1024) for i in range(12))),
    "descriptors_per_transfer": (
        "producer: NIXL descriptors this rank posted for one transfer (every part and "
        "attempt)",
        tuple(float(4**i) for i in range(11))),
}
#: Prefix of the per-reason failure counts in the stats' data.
FAILED_REASON = "failed_reason:"


class PushKVStats(KVConnectorStats):
    """Counts and observations since the previous report; merged across workers."""

    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, n: int = 1) -> None:
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def observe(self, name: str, value: float) -> None:
        self.data.setdefault(name, []).append(value)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, int | float):
                self.data[k] = self.data.get(k, 0) + v
            elif isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if isinstance(v, int | float):
                out[k] = v
            elif isinstance(v, list) and v:
                out[f"{k}_count"] = len(v)
                out[f"{k}_mean"] = round(sum(v) / len(v), 6)
        return out

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
        self._engines = per_engine_labelvalues
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"pushkv:{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._by_reason = self._counter_cls(
            name="pushkv:transfers_failed_by_reason",
            documentation="transfers that failed, by reason (the protocol's FailReason)",
            labelnames=[*labelnames, "reason"])
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, doc in GAUGES.items():
            gauge = self._gauge_cls(name=f"pushkv:{name}", documentation=doc,
                                    labelnames=labelnames, multiprocess_mode="livesum")
            self._gauges[name] = {
                idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._histograms: dict[str, dict[int, Any]] = {}
        for name, (doc, buckets) in HISTOGRAMS.items():
            hist = self._histogram_cls(name=f"pushkv:{name}", documentation=doc,
                                       labelnames=labelnames, buckets=list(buckets))
            self._histograms[name] = {
                idx: hist.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name.startswith(FAILED_REASON) and engine_idx in self._engines and value:
                labels = [*self._engines[engine_idx], name[len(FAILED_REASON):]]
                self._by_reason.labels(*labels).inc(value)
            elif isinstance(value, list):
                hist = self._histograms.get(name, {}).get(engine_idx)
                if hist is not None:
                    for v in value:
                        hist.observe(v)
            elif name in self._gauges:
                gauge = self._gauges[name].get(engine_idx)
                if gauge is not None and value:
                    gauge.inc(value)  # a change, of either sign
            else:
                per_engine = self._counters.get(name)
                if per_engine is not None and engine_idx in per_engine and value:
                    per_engine[engine_idx].inc(value)
