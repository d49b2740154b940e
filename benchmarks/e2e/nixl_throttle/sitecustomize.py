"""Benchmark-only: let vLLM's own NIXL connectors' progress thread sleep between polls.

NIXL's Python wrapper creates every agent with ``pthrDelay = 0``, so the UCX
progress thread of each agent busy-spins a core, even when idle. bench_e2e.sh
puts this directory on ``PYTHONPATH`` of the baseline servers (``--nixl-delay-us``)
so every process of those servers creates its agents with the delay given in
``PUSHKV_BENCH_NIXL_DELAY_US`` -- the same setting pushkv's transport uses --
and the comparison measures the transfer design, not a spinning thread.
"""

import os

_DELAY = int(os.environ.get("PUSHKV_BENCH_NIXL_DELAY_US", "0") or 0)

if _DELAY > 0:
    try:
        import nixl._api as _api

        _bind = _api.nixlBind
        _original = _bind.nixlAgent

        def _throttled(name, config):  # type: ignore[no-untyped-def]
            config.pthrDelay = _DELAY
            return _original(name, config)

        _bind.nixlAgent = _throttled
    except Exception:  # nixl missing or changed: run unthrottled
        pass
