"""Health checks, failover, load-aware choice and the client's bound in ``pushkv proxy``,
against stand-in servers (the proxy's own logic; real engines fail over in test_chaos.py).

Waits are on conditions (a leg arrived, an instance left rotation), never on time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pushkv.vllm.params import parse_params
from pushkv.vllm.proxy.pool import HealthSettings, Instance, Pool
from pushkv.vllm.proxy.server import ProxySettings, PushProxy
from pushkv.vllm.testing import metric

from .test_proxy import REQUEST, FakeVllm

FAST = HealthSettings(interval_s=0.05, timeout_s=0.2, unhealthy_after=2, backoff_max_s=0.4)
#: Probes too slow to change an instance's state within a test: a state seen is the
#: request path's doing.
SLOW_PROBES = HealthSettings(interval_s=30, timeout_s=5, unhealthy_after=2, backoff_max_s=30)


async def until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


Scenario = Callable[[str, PushProxy, aiohttp.ClientSession], Awaitable[None]]


def run(prefill: list[FakeVllm], decode: list[FakeVllm], scenario: Scenario,
        **settings: Any) -> None:
    async def main() -> None:
        servers = [TestServer(f.app()) for f in prefill + decode]
        for s in servers:
            await s.start_server()
        try:
            urls = [str(s.make_url("")) for s in servers]
            proxy = PushProxy(urls[: len(prefill)], urls[len(prefill):], settings=ProxySettings(
                **{"health": FAST, "request_timeout_s": 20.0, **settings}))
            async with TestServer(proxy.app()) as front, aiohttp.ClientSession() as s:
                await scenario(str(front.make_url("")).rstrip("/"), proxy, s)
        finally:
            for s in servers:
                await s.close()

    asyncio.run(main())


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
               ) -> tuple[int, Any]:
    async with s.post(url + "/v1/completions", json=body or REQUEST) as r:
        return r.status, await r.json()


async def counter(s: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with s.get(url + "/metrics") as r:
        return metric(await r.text(), name, **labels)


def transfer(leg: Any) -> str:
    parsed = parse_params(leg.body["kv_transfer_params"])
    assert parsed is not None and not isinstance(parsed, str)
    return str(parsed.transfer_id)  # type: ignore[union-attr]


def test_a_refused_prefill_is_retried_once_on_another_producer_as_a_new_transfer():
    # Refused: no engine accepted the request, so another may serve it (an engine
    # that failed on it does not get it again: test_a_request_that_made_an_engine_...).
    bad, good = FakeVllm("prefill"), FakeVllm("prefill")
    d = FakeVllm("decode", delay_s=1.0)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        # Make the failing producer the first choice: the other one looks busy.
        proxy.prefill[1].work = 10**6
        proxy.prefill[0].url = "http://127.0.0.1:9"  # nothing listens: refused
        status, body = await post(s, url)
        proxy.prefill[1].work = 0
        assert status == 200 and body["choices"][0]["text"] == " w5 w6 w7"
        assert await counter(s, url, "pushkv_proxy_retries_total") == 1
        assert await counter(s, url, "pushkv_proxy_failovers_total", role="prefill") == 1
        assert await counter(s, url, "pushkv_proxy_requests_total", outcome="ok") == 1
        assert not proxy.prefill[0].up

    run([bad, good], [d], scenario, health=SLOW_PROBES)
    (second,) = good.legs
    assert bad.legs == [] and 1 <= len(d.legs) <= 2  # the first decode leg was cancelled
    assert transfer(second) == transfer(d.legs[-1])  # a new transfer
    assert len({transfer(leg) for leg in d.legs}) == len(d.legs)


def test_a_hung_producer_leaves_rotation_and_its_requests_fail_over():
    hung, good = FakeVllm("prefill"), FakeVllm("prefill")
    d = FakeVllm("decode", delay_s=1.0)  # as if waiting for the KV

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        await until(lambda: hung.probes > 0 and good.probes > 0)
        proxy.prefill[1].work = 10**6  # the hung one is chosen first
        hung.hang = True  # a stopped process: accepts connections, answers nothing
        status, _ = await post(s, url)
        assert status == 200
        assert not proxy.prefill[0].up and proxy.prefill[1].up
        assert await counter(s, url, "pushkv_proxy_instance_up", role="prefill") == 1
        # Thawed, it is probed back into rotation (with back-off), and asked again who
        # it is (a restart may change its side channel) before it is back.
        assert hung.discoveries == 1 and proxy.prefill[0].endpoint is None
        hung.hang = False
        await until(lambda: proxy.prefill[0].up)
        assert hung.discoveries == 2 and proxy.prefill[0].endpoint is not None

    run([hung, good], [d], scenario)
    assert len(hung.legs) == 1 and hung.legs[0].cancelled and len(good.legs) == 1


def test_a_refused_decode_leg_fails_over_to_another_decode_instance():
    p = FakeVllm("prefill", delay_s=0.05)
    d1, d2 = FakeVllm("decode"), FakeVllm("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[0].url = "http://127.0.0.1:9"  # nothing listens: refused
        proxy.decode[1].work = 10**6
        status, _ = await post(s, url)
        assert status == 200
        assert not proxy.decode[0].up
        assert await counter(s, url, "pushkv_proxy_failovers_total", role="decode") == 1

    run([p], [d1, d2], scenario)
    assert len(d2.legs) == 1 and len(p.legs) == 2


def test_no_producer_left_the_decode_policy_decides():
    def scenario_for(expect: int) -> Scenario:
        async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
            await until(lambda: proxy.prefill[0].up is False)
            status, body = await post(s, url)
            assert status == expect, body
        return scenario

    for policy, expect in (("recompute", 200), ("fail", 503)):
        p = FakeVllm("prefill", healthy=False)
        d = FakeVllm("decode", policy=policy)
        run([p], [d], scenario_for(expect))
        assert p.legs == []
        if policy == "recompute":  # served by the decode instance alone, no transfer
            (leg,) = d.legs
            assert "kv_transfer_params" not in leg.body
        else:
            assert d.legs == []


def test_the_retry_budget_is_one_then_the_error_is_clear():
    p1, p2, p3 = FakeVllm("prefill"), FakeVllm("prefill"), FakeVllm("prefill")
    d = FakeVllm("decode", delay_s=1.0)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        for inst in proxy.prefill[:2]:
            inst.url = "http://127.0.0.1:9"  # nothing listens: refused
        proxy.prefill[2].work = 10**6  # the last choice: never reached
        status, body = await post(s, url)
        assert status == 502 and "http://127.0.0.1:9" in body["error"]["message"]
        assert [i.up for i in proxy.prefill] == [False, False, True]
        assert await counter(s, url, "pushkv_proxy_retries_total") == 1

    run([p1, p2, p3], [d], scenario, health=SLOW_PROBES)
    assert p1.legs == p2.legs == p3.legs == []


def test_least_outstanding_work_wins():
    p = FakeVllm("prefill")
    d1, d2 = FakeVllm("decode", delay_s=2.0), FakeVllm("decode", delay_s=2.0)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        long = dict(REQUEST, prompt=[7] * 100, max_tokens=100)
        first = asyncio.create_task(post(s, url, long))
        await until(lambda: len(d1.legs) + len(d2.legs) == 1)
        busy = d1 if d1.legs else d2
        others = [asyncio.create_task(post(s, url)) for _ in range(3)]
        await until(lambda: len(d1.legs) + len(d2.legs) == 4)
        assert len(busy.legs) == 1  # every short request went to the idle instance
        assert all(r[0] == 200 for r in await asyncio.gather(first, *others))

    run([p], [d1, d2], scenario)


def test_a_client_never_waits_past_the_bound():
    p, d = FakeVllm("prefill"), FakeVllm("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        await until(lambda: p.probes > 0)
        d.hang = p.hang = True  # both hang; probes fail, so nothing is retried
        status, body = await post(s, url)
        assert status == 504 and body["error"]["message"]

    run([p], [d], scenario, request_timeout_s=1.0,
        health=HealthSettings(interval_s=30, timeout_s=30))
    assert p.legs[0].cancelled and d.legs[0].cancelled


def test_pool_backs_off_while_down_and_resets_when_up():
    pool = Pool(["http://p"], ["http://d"],
                HealthSettings(interval_s=1, timeout_s=1, unhealthy_after=2, backoff_max_s=5))
    (p,) = pool.prefill
    seen: list[tuple[Instance, bool]] = []
    pool.listeners.append(lambda i, up: seen.append((i, up)))
    pool.probed(p, False, now=0)
    assert p.up  # one failure is not enough
    pool.probed(p, False, now=1)
    assert not p.up and p.next_probe == 2
    waits = []
    for now in range(2, 40, 1):
        if p.next_probe <= now:
            pool.probed(p, False, now=now)
            waits.append(p.backoff_s)
    assert waits[:4] == [2, 4, 5, 5]
    pool.probed(p, True, now=50)
    assert p.up and p.backoff_s == 0 and p.next_probe == 51
    assert seen == [(p, False), (p, True)]
    assert pool.pick("prefill") is p
    pool.mark_down(p, "refused", now=60)
    assert pool.pick("prefill") is None and not p.up



def test_a_generating_probe_catches_an_engine_stuck_behind_a_healthy_server():
    stuck, good = FakeVllm("prefill"), FakeVllm("prefill")
    d = FakeVllm("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        assert (await post(s, url))[0] == 200  # the proxy learns the model
        stuck.delay_s = 60  # completions hang, /health still answers 200
        await until(lambda: not proxy.prefill[0].up)
        assert proxy.prefill[1].up and proxy.decode[0].up
        stuck.delay_s = 0
        await until(lambda: proxy.prefill[0].up)

    run([stuck, good], [d], scenario, health=HealthSettings(
        interval_s=0.05, timeout_s=0.5, unhealthy_after=2, backoff_max_s=0.2,
        generate_timeout_s=0.5))


# ------------------------------------------- health is the probes' business

def _record_downs(proxy: PushProxy) -> list[str]:
    downs: list[str] = []
    proxy.pool.listeners.append(lambda inst, up: None if up else downs.append(inst.role))
    return downs


@pytest.mark.parametrize(("role", "status"), [
    ("prefill", 500), ("prefill", 503), ("decode", 500), ("decode", 503)])
def test_an_engine_error_answer_leaves_its_instance_in_rotation(role, status):
    p = FakeVllm("prefill", status=status if role == "prefill" else 200)
    d = FakeVllm("decode", status=status if role == "decode" else 200,
                 delay_s=0.5 if role == "prefill" else 0.0)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        downs = _record_downs(proxy)
        for _ in range(2):
            got, _ = await post(s, url)
            assert got >= 500
        assert downs == [] and all(i.up for i in proxy.pool.all)
        assert await counter(s, url, "pushkv_proxy_instance_up") == 2

    run([p], [d], scenario, health=SLOW_PROBES)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_engine_dropping_one_request_leaves_its_instance_in_rotation(role):
    p = FakeVllm("prefill", drop_legs=1 if role == "prefill" else 0)
    d = FakeVllm("decode", drop_legs=1 if role == "decode" else 0,
                 delay_s=0.5 if role == "prefill" else 0.0)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        downs = _record_downs(proxy)
        await post(s, url)
        assert downs == [] and all(i.up for i in proxy.pool.all)
        assert (await post(s, url))[0] == 200  # the instance serves the next request
        assert p.legs and d.legs

    run([p], [d], scenario, health=SLOW_PROBES)


def test_probes_and_refused_connections_still_take_instances_out():
    p, d = FakeVllm("prefill"), FakeVllm("decode", healthy=False)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        await until(lambda: not proxy.decode[0].up)  # probes answered 503
        proxy.prefill[0].url = "http://127.0.0.1:9"  # nothing listens: refused
        d.healthy = True
        await until(lambda: proxy.decode[0].up)
        downs = _record_downs(proxy)
        await post(s, url)
        assert downs == ["prefill"] and not proxy.prefill[0].up

    run([p], [d], scenario)


# ---------------------------------------------------------- poison requests

@pytest.mark.parametrize(("role", "how"), [
    ("prefill", "answer"), ("prefill", "drop"), ("decode", "answer"), ("decode", "drop"),
    ("decode", "stream")])
def test_a_request_that_made_an_engine_fail_is_not_sent_to_another(role, how):
    """5xx, or accepted and dropped: the next instance could fail the same way."""
    fail = {"answer": {"fail_legs": 9}, "drop": {"drop_legs": 9},
            "stream": {"stream_error": True}}[how]
    bad, good = FakeVllm(role, **fail), FakeVllm(role)
    other = FakeVllm("decode" if role == "prefill" else "prefill",
                     delay_s=0.5 if role == "prefill" else 0.0)
    pools = ([bad, good], [other]) if role == "prefill" else ([other], [bad, good])
    said = {"answer": "Internal server error", "drop": "dropped the request",
            "stream": "Internal server error"}[how]

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.pool.of(role)[1].work = 10**6  # the failing instance is the first choice
        bad_url = proxy.pool.of(role)[0].url
        async with s.post(url + "/v1/completions",
                          json=dict(REQUEST, stream=how == "stream")) as r:
            status, body, leg = r.status, await r.json(), r.headers["X-PushKV-Leg"]
        assert status >= 500 and leg == role
        message = body["error"]["message"]
        assert bad_url in message and said in message and "not sent to another" in message
        assert body["error"]["code"] == status
        assert await counter(s, url, "pushkv_proxy_retries_total") == 0
        assert all(i.up for i in proxy.pool.all)

    run(*pools, scenario, health=SLOW_PROBES)
    assert len(bad.legs) == 1 and good.legs == []


# ------------------------------------------- each instance runs pushkv in its role

async def health(s: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with s.get(url + "/health") as r:
        return r.status, await r.json()


def test_a_decode_instance_without_the_connector_is_refused_until_it_runs_it(caplog):
    p, d = FakeVllm("prefill"), FakeVllm("decode", kv_role="none")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        (inst,) = proxy.decode
        assert not inst.up  # refused at start, before any request
        probes = d.probes
        await until(lambda: d.probes >= probes + 3)  # probed again: still refused
        status, body = await health(s, url)
        assert status == 503 and body["reason"] == "no decode instance is in rotation"
        why = body["out_of_rotation"][inst.url]
        assert "does not run PushKVConnector" in why and '"kv_role":"kv_consumer"' in why
        assert (await post(s, url))[0] == 503
        assert d.legs == [] and p.legs == []
        lines = [r.getMessage() for r in caplog.records
                 if r.levelno >= logging.WARNING and inst.url in r.getMessage()]
        assert len(lines) == 1 and "does not run PushKVConnector" in lines[0], lines
        d.kv_role = ""  # restarted with the connector: the next probe lets it in
        await until(lambda: inst.up)
        assert (await health(s, url))[0] == 200 and (await post(s, url))[0] == 200

    with caplog.at_level(logging.INFO, logger="pushkv.proxy"):
        run([p], [d], scenario)


def test_an_instance_in_the_other_role_is_refused_and_checked_again_when_it_returns():
    p1, p2 = FakeVllm("prefill"), FakeVllm("prefill", kv_role="kv_consumer")
    d = FakeVllm("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        good, wrong = proxy.prefill
        assert good.up and not wrong.up
        status, body = await health(s, url)
        assert status == 200  # one producer is enough to serve
        why = body["out_of_rotation"][wrong.url]
        assert "as kv_consumer, but is given as --prefill" in why and "--decode" in why
        for _ in range(3):
            assert (await post(s, url))[0] == 200
        assert p2.legs == [] and len(p1.legs) == 3
        # The good one goes away and comes back in the wrong role: it stays out.
        p1.healthy = False
        await until(lambda: not good.up)
        p1.kv_role, p1.healthy = "kv_consumer", True
        discoveries = p1.discoveries
        await until(lambda: p1.discoveries > discoveries + 1)
        assert not good.up and "kv_consumer" in good.why
        assert (await health(s, url))[0] == 503

    run([p1, p2], [d], scenario)


def test_retarget_sends_the_same_decode_leg_a_turn_later_and_prefills_once():
    """failover = "retarget": the decode leg a refused instance never took goes, for the
    same transfer (same id and incarnation), to another decode instance at turn 1
    (protocol rule 12); the prompt is prefilled once."""
    p = FakeVllm("prefill", delay_s=0.05)
    d1, d2 = FakeVllm("decode"), FakeVllm("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[0].url = "http://127.0.0.1:9"  # nothing listens: refused
        proxy.decode[1].work = 10**6
        status, _ = await post(s, url)
        assert status == 200
        assert not proxy.decode[0].up

    run([p], [d1, d2], scenario, failover="retarget")
    assert len(p.legs) == 1 and len(d2.legs) == 1
    leg = parse_params(d2.legs[0].body["kv_transfer_params"])
    first = parse_params(p.legs[0].body["kv_transfer_params"])
    assert (leg.transfer_id, leg.incarnation) == (first.transfer_id, first.incarnation)
    assert leg.target == 1


@dataclass
class GatedVllm(FakeVllm):
    """A stand-in whose legs (not discovery requests) wait until ``gate`` is set
    (``waiting`` counts them)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)  #: the waiting legs' params

    async def completions(self, request: web.Request) -> web.StreamResponse:
        params = (await request.json()).get("kv_transfer_params") or {}
        if not params.get("pushkv_discover"):
            self.waiting += 1
            self.seen.append(params)
            await self.gate.wait()
        return await super().completions(request)


def test_a_retarget_that_finds_no_source_is_reissued_once_to_the_same_producer():
    """failover = "retarget": the re-targeted decode leg fails on an instance that
    stays healthy (the producer had released the source: the first decode instance
    had all of it) -- the request goes once more as a new transfer, to the prefill
    instance of the first attempt (its prefix cache holds the prompt) even when
    another is less loaded, and its answer reaches the client. A second failure is
    the client's error, naming the instance that failed."""
    p1, p2 = FakeVllm("prefill"), FakeVllm("prefill")
    d1, d2 = FakeVllm("decode"), GatedVllm("decode", fail_legs=1)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[0].url = "http://127.0.0.1:9"  # nothing listens: refused
        proxy.pool.drain(proxy.prefill[1])
        task = asyncio.ensure_future(post(s, url))
        await until(lambda: d2.waiting == 1)  # the re-targeted leg arrived
        proxy.pool.undrain(proxy.prefill[1])
        proxy.prefill[0].work += 10**6  # the other producer is now the least loaded
        d2.gate.set()
        status, _ = await task
        assert status == 200
        assert await counter(s, url, "pushkv_proxy_failover_causes_total",
                             cause="source_released") == 1
        assert await counter(s, url, "pushkv_proxy_failover_prompt_tokens_total",
                             stage="before_answer") > 0

    run([p1, p2], [d1, d2], scenario, failover="retarget")
    assert len(p1.legs) == 2 and not p2.legs
    assert len(d2.legs) == 2
    first, retargeted, reissued = (parse_params(leg.body["kv_transfer_params"])
                                   for leg in (p1.legs[0], d2.legs[0], d2.legs[1]))
    assert (retargeted.transfer_id, retargeted.target) == (first.transfer_id, 1)
    assert reissued.transfer_id == transfer(p1.legs[1]) != first.transfer_id
    assert reissued.target == 0


def test_a_reissue_that_fails_too_gives_the_client_the_instance_s_error():
    p = FakeVllm("prefill")
    d1, d2 = FakeVllm("decode"), FakeVllm("decode", fail_legs=2)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[0].url = "http://127.0.0.1:9"
        status, body = await post(s, url)
        assert status == 500, body
        assert proxy.decode[1].url in body["error"]["message"]
        assert "went away" not in body["error"]["message"]

    run([p], [d1, d2], scenario, failover="retarget")
    assert len(p.legs) == 2 and len(d2.legs) == 2


@pytest.mark.parametrize("bind", ["arrival", "late"])
def test_late_binding_picks_the_decode_instance_once_the_prefill_leg_answered(bind):
    """bind = "late": the decode leg leaves once the prefill leg answered, to the decode
    instance least loaded then; "arrival": both legs leave at once, to the instance
    least loaded at arrival."""
    p = GatedVllm("prefill")
    d1, d2 = FakeVllm("decode"), FakeVllm("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[1].work = 10**6  # at arrival, decode 1 is the least loaded
        task = asyncio.ensure_future(post(s, url))
        await until(lambda: p.waiting == 1)
        if bind == "arrival":
            await until(lambda: len(d1.legs) == 1)
        assert not d2.legs and len(d1.legs) == (bind == "arrival")
        proxy.decode[1].work -= 10**6
        proxy.decode[0].work += 10**6  # ...and no longer once the prefill answers
        p.gate.set()
        status, _ = await task
        assert status == 200
        proxy.decode[0].work -= 10**6

    run([p], [d1, d2], scenario, bind=bind)
    chosen = d1 if bind == "arrival" else d2
    assert len(chosen.legs) == 1 and p.waiting == 1
    prefill_leg = parse_params(p.seen[0])
    assert prefill_leg is not None and not isinstance(prefill_leg, str)
    assert transfer(chosen.legs[0]) == prefill_leg.transfer_id  # type: ignore[union-attr]
    if bind == "late":  # sent once the prefill leg answered (arrival: its answer is not
        assert chosen.legs[0].arrived >= p.legs[0].answered  # waited for)
