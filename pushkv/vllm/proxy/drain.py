"""Taking an instance out of ``pushkv proxy`` on purpose: the admin calls.

* ``POST /admin/drain?instance=URL`` -- the instance (prefill or decode, its
  base URL as given to the proxy) gets no new leg. Requests waiting on it whose
  answer has not begun (a streamed answer before its first token) move to other
  instances as the failover policy says (:mod:`.failover`, cause ``drained``);
  running streams and non-streamed requests finish where they are. The answer:
  ``{"instance", "role", "drained": true, "outstanding"}`` (legs still in flight
  on it). Poll it, or ``pushkv_proxy_instance_outstanding``, until 0 before
  stopping the instance; a stream it is still serving when it stops is resumed
  elsewhere (:mod:`.resume`).
* ``POST /admin/undrain?instance=URL`` -- it gets legs again (when its probes
  say it is up).

A missing or unknown ``instance`` is answered 400 or 404 with an OpenAI-style
error, and nothing changes. The calls take no key: bind the proxy (``--host``)
where only operators and clients you trust reach it.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from .input import error_body
from .metrics import ProxyMetrics
from .pool import Instance, Pool

DRAIN = "/admin/drain"
UNDRAIN = "/admin/undrain"


class Admin:
    """The admin routes over a proxy's pool."""

    def __init__(self, pool: Pool, metrics: ProxyMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(DRAIN, self.drain)
        app.router.add_post(UNDRAIN, self.undrain)

    async def drain(self, request: web.Request) -> web.Response:
        return self._act(request, self.pool.drain)

    async def undrain(self, request: web.Request) -> web.Response:
        return self._act(request, self.pool.undrain)

    def _act(self, request: web.Request, act: Callable[[Instance], None]) -> web.Response:
        url = request.query.get("instance", "")
        if not url:
            return web.json_response(error_body(
                "give the instance's base URL: ?instance=http://host:port", 400, "instance"),
                status=400)
        inst = self.pool.find(url)
        if inst is None:
            known = ", ".join(i.url for i in self.pool.all)
            return web.json_response(error_body(
                f"no instance {url!r:.200} behind this proxy (it has {known:.500})", 404,
                "instance"), status=404)
        act(inst)
        self.metrics.instance(inst)
        return web.json_response(state(inst))


def state(inst: Instance) -> dict[str, object]:
    return {"instance": inst.url, "role": inst.role, "drained": inst.drained,
            "up": inst.up, "outstanding": inst.inflight}
