"""The push-mode proxy: an OpenAI-compatible router in front of vLLM prefill and decode.

* :mod:`.server` -- :class:`PushProxy`, the aiohttp application: both legs of a
  request at once, health, failover, signing (see its docstring).
* :mod:`.settings` -- :class:`ProxySettings`, one field per flag.
* :mod:`.upstream` -- probes, discovery and the errors of calls to instances.
* :mod:`.legs` -- a leg's error and what may end an attempt early.
* :mod:`.failover` -- the failover policies (retry, retarget) and when they apply.
* :mod:`.resume` -- resuming a broken stream on another decode instance.
* :mod:`.drain` -- the admin calls that drain an instance.
* :mod:`.input` -- the checks a client's request passes before any engine sees it.
* :mod:`.sse` -- reading and relaying server-sent events.
* :mod:`.pool` -- the instances, their health probes and the choice among them.
* :mod:`.metrics` -- the Prometheus metrics ``/metrics`` serves.
* :mod:`.cli` -- ``pushkv proxy``: flags, settings, the event loop.

Dependencies point one way: ``cli -> server -> upstream, drain, resume -> settings
-> failover -> legs -> input, sse, pool, metrics``.
Only aiohttp, prometheus_client and the standard library are imported (not
vLLM, not torch).
"""

from .server import ProxySettings, PushProxy

__all__ = ["ProxySettings", "PushProxy"]
