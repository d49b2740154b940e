"""Prometheus metrics of ``pushkv proxy`` (served on its ``/metrics``).

Each proxy owns a registry, so several proxies in one process (tests) do not
collide. Names, for dashboards and alerts:

* ``pushkv_proxy_requests_total{outcome}``: ``ok``, ``client_error`` (refused
  by the proxy's checks or an engine's 4xx), ``upstream_error`` (a leg failed:
  502/500), ``unavailable`` (503: no instance in rotation), ``timeout`` (504:
  the request's bound passed), ``cancelled`` (the client left).
* ``pushkv_proxy_legs_total{role, outcome}``: each leg sent: ``ok``,
  ``refused`` (4xx), ``failed`` (5xx, broken, instance went down), ``cancelled``.
* ``pushkv_proxy_retries_total``: requests sent again as a new transfer after a
  leg failed before any output; ``pushkv_proxy_failovers_total{role}``: the
  retry went to another instance of that role.
* ``pushkv_proxy_failover_causes_total{stage, role, cause}``: failovers by
  stage (``before_answer``: a retry; ``mid_stream``: a resumed stream), the
  failed leg's role, and cause (``unreachable``, ``timeout``, ``out_of_rotation``,
  ``drained``, ``gone``, ``source_released``: see :mod:`.failover`).
* ``pushkv_proxy_failover_prompt_tokens_total{stage}``: prompt tokens a failover
  sent to a prefill instance again (a retry: the prompt; a resume: the prompt
  plus the tokens already streamed). The prefill's prefix cache may serve part
  of them (vLLM's ``vllm:prefix_cache_hits`` on that instance).
* ``pushkv_proxy_resume_seconds``: the gap a resumed answer met, from its last
  token before the break to the first one after (a stream's client sees it; an
  answer assembled from a stream comes that much later).
* ``pushkv_proxy_assembled_total{outcome}``: non-streamed completions and how
  they were answered: ``ok`` (assembled from a streamed decode leg, so a decode
  death after the first token is resumed: :mod:`.assemble`), ``passed_through``
  (an option that cannot be assembled: sent non-streamed as asked), ``failed``
  (the stream could not be assembled; the client got a 5xx).
* ``pushkv_proxy_recomputed_total``: requests served by a decode instance
  alone (no producer left, ``kv_load_failure_policy=recompute``).
* ``pushkv_proxy_instance_up{role, url}`` (1 in rotation, 0 out),
  ``pushkv_proxy_instance_drained{role, url}`` (1 while drained),
  ``pushkv_proxy_instance_outstanding{role, url}`` (legs in flight).
* ``pushkv_proxy_ttft_seconds``, ``pushkv_proxy_request_seconds``: time to the
  first byte of the answer, and to its end, of successful requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .pool import Instance

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    """The proxy's counters, gauges and histograms in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pushkv_proxy_requests", "client requests by outcome",
                                ["outcome"], registry=r)
        self.legs = Counter("pushkv_proxy_legs", "legs sent to instances, by role and outcome",
                            ["role", "outcome"], registry=r)
        self.retries = Counter("pushkv_proxy_retries",
                               "requests sent again as a new transfer", registry=r)
        self.failovers = Counter("pushkv_proxy_failovers",
                                 "retries that went to another instance, by role", ["role"],
                                 registry=r)
        self.assembled = Counter(
            "pushkv_proxy_assembled", "non-streamed completions by how they were answered",
            ["outcome"], registry=r)
        self.recomputed = Counter("pushkv_proxy_recomputed",
                                  "requests a decode instance served alone", registry=r)
        self.failover_causes = Counter(
            "pushkv_proxy_failover_causes", "failovers by stage, failed leg and cause",
            ["stage", "role", "cause"], registry=r)
        self.failover_prompt_tokens = Counter(
            "pushkv_proxy_failover_prompt_tokens",
            "prompt tokens sent to a prefill instance again because of a failover",
            ["stage"], registry=r)
        self.resume_gap = Histogram(
            "pushkv_proxy_resume_seconds", "a resumed answer's gap (streamed or assembled "
            "from a stream): the last token before the break to the first after",
            buckets=_BUCKETS, registry=r)
        self.drained = Gauge("pushkv_proxy_instance_drained", "1 while the instance is "
                             "drained", ["role", "url"], registry=r)
        self.up = Gauge("pushkv_proxy_instance_up", "1 when the instance is in rotation",
                        ["role", "url"], registry=r)
        self.outstanding = Gauge("pushkv_proxy_instance_outstanding", "legs in flight",
                                 ["role", "url"], registry=r)
        self.ttft = Histogram("pushkv_proxy_ttft_seconds",
                              "time to the first byte of a successful answer",
                              buckets=_BUCKETS, registry=r)
        self.latency = Histogram("pushkv_proxy_request_seconds",
                                 "time to the end of a successful answer", buckets=_BUCKETS,
                                 registry=r)

    def instance(self, inst: Instance) -> None:
        self.up.labels(inst.role, inst.url).set(1 if inst.up else 0)
        self.drained.labels(inst.role, inst.url).set(1 if inst.drained else 0)
        self.outstanding.labels(inst.role, inst.url).set(inst.inflight)

    def render(self) -> bytes:
        return generate_latest(self.registry)
