"""The connector's metrics: counts, failures by reason and histograms, merged across
workers, logged by vLLM and exposed as Prometheus metrics."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pushkv.vllm.stats import (
    EARLY_BYTES,
    FAILED_REASON,
    HISTOGRAMS,
    PushKVPromMetrics,
    PushKVStats,
)
from pushkv.vllm.testing import metric

pytestmark = pytest.mark.vllm


def test_workers_stats_merge_and_reduce_for_the_log():
    a, b = PushKVStats(), PushKVStats()
    a.add("transfers_ready", 2)
    a.observe("registration_to_ready_seconds", 0.5)
    b.add("transfers_ready")
    b.add(FAILED_REASON + "WINDOW_EXPIRED")
    b.observe("registration_to_ready_seconds", 1.5)
    merged = a.aggregate(b)
    assert merged.data["transfers_ready"] == 3
    assert merged.data["registration_to_ready_seconds"] == [0.5, 1.5]
    assert merged.reduce() == {"failed_reason:WINDOW_EXPIRED": 1, "transfers_ready": 3,
                               "registration_to_ready_seconds_count": 2,
                               "registration_to_ready_seconds_mean": 1.0}
    assert not merged.is_empty() and PushKVStats().is_empty()


def test_prometheus_metrics_per_engine():
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = PushKVPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["engine"], {0: ["0"], 1: ["1"]})
    prom.observe({"transfers_failed": 2, FAILED_REASON + "PRODUCER_DEAD": 2,
                  "transfer_bytes": [1024.0, 4096.0], "transfer_seconds": [0.01]}, 1)
    text = generate_latest(reg).decode()
    assert metric(text, "pushkv:transfers_failed_total", engine="1") == 2
    assert metric(text, "pushkv:transfers_failed_by_reason_total", engine="1",
                  reason="PRODUCER_DEAD") == 2
    assert metric(text, "pushkv:transfer_bytes_count", engine="1") == 2
    assert metric(text, "pushkv:transfer_bytes_sum", engine="1") == 5120
    assert metric(text, "pushkv:transfer_seconds_count", engine="1") == 1
    assert metric(text, "pushkv:transfer_seconds_count", engine="0") == 0
    for name in HISTOGRAMS:
        assert f"pushkv:{name}_bucket" in text


def test_progressive_push_counters_are_exported():
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = PushKVPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["engine"], {0: ["0"]})
    a, b = PushKVStats(), PushKVStats()
    a.add(EARLY_BYTES, 4096)
    a.add("ranges_reported", 3)
    b.add(EARLY_BYTES, 1024)
    prom.observe(a.aggregate(b).data, 0)
    text = generate_latest(reg).decode()
    assert metric(text, "pushkv:bytes_before_prefill_end_total", engine="0") == 5120
    assert metric(text, "pushkv:ranges_reported_total", engine="0") == 3


def test_packed_write_counters_and_the_staging_gauge():
    """Workers report the staging they lend as changes; the gauge sums them back."""
    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = PushKVPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                             ["engine"], {0: ["0"]})
    lend, back = PushKVStats(), PushKVStats()
    lend.add("staging_bytes_lent", 4096)
    lend.add("writes_scattered", 2)
    prom.observe(lend.data, 0)
    text = generate_latest(reg).decode()
    assert metric(text, "pushkv:staging_bytes_lent", engine="0") == 4096
    back.add("staging_bytes_lent", -4096)
    back.add("writes_packed", 3)
    prom.observe(back.data, 0)
    text = generate_latest(reg).decode()
    assert metric(text, "pushkv:staging_bytes_lent", engine="0") == 0
    assert metric(text, "pushkv:writes_packed_total", engine="0") == 3
    assert metric(text, "pushkv:writes_scattered_total", engine="0") == 2
    assert back.reduce() == {"staging_bytes_lent": -4096, "writes_packed": 3}
