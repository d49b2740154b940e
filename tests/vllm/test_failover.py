"""Failover in ``pushkv proxy`` against stand-in servers: resumed streams, the named
policies, drain (real engines: test_failover_e2e.py).

The stand-in decode instances generate a deterministic function of the whole
token sequence (prompt plus what came so far), so a continuation sent with the
wrong prompt, ``max_tokens`` or sampling settings gives other tokens than an
uninterrupted answer. Waits are on conditions, never on time."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pushkv.vllm.proxy import cli as proxy_cli
from pushkv.vllm.proxy.failover import RETARGET
from pushkv.vllm.proxy.resume import NotResumable, Tap, continuation
from pushkv.vllm.proxy.server import ProxySettings, PushProxy
from pushkv.vllm.testing import metric

from .test_proxy import FakeVllm
from .test_proxy_failover import FAST, SLOW_PROBES, counter, run, until

PROMPT = [11, 12, 13, 14]


def next_token(seq: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(seq)) % 991) + 5


def greedy(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


@dataclass
class StreamingDecode(FakeVllm):
    """A decode stand-in that streams like vLLM (``prompt_token_ids`` first, one token an
    event, usage at the end when asked) and can die after some events: its connection
    closes and its /health stops answering 200."""

    name: str = "d"
    die_after: int = 0  #: events of its first leg before it breaks the stream (0: never)
    stays_healthy: bool = False  #: breaking the stream off, it still answers /health
    dead: bool = False
    #: Set by the client once it holds ``die_after`` events: the stream breaks then.
    die: asyncio.Event = field(default_factory=asyncio.Event)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params")
        if self.dead:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if not body.get("stream") or (params and params.get("pushkv_discover")):
            return await super().completions(request)
        self.legs.append(_leg(body, request))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        prompt, n = list(body["prompt"]), int(body["max_tokens"])
        ids = body.get("return_token_ids")
        for i, tok in enumerate(greedy(prompt, n)):
            choice: dict[str, Any] = {"index": 0, "text": f" w{tok}",
                                      "finish_reason": "length" if i == n - 1 else None}
            if ids:
                choice["token_ids"] = [tok]
                if i == 0:
                    choice["prompt_token_ids"] = prompt
            event = {"id": f"cmpl-{self.name}", "created": len(self.legs),
                     "choices": [choice]}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if self.die_after and len(self.legs) == 1 and i + 1 == self.die_after:
                await self.die.wait()
                self.dead = not self.stays_healthy
                assert request.transport is not None
                request.transport.close()
                return out
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                     "total_tokens": len(prompt) + n}
            await out.write(b"data: " + json.dumps({"id": f"cmpl-{self.name}",
                                                    "choices": [], "usage": usage}).encode()
                            + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _leg(body: dict[str, Any], request: web.Request) -> Any:
    from .test_proxy import Leg

    return Leg(body=body, headers=dict(request.headers), arrived=0.0)


async def raw_stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     tell: StreamingDecode | None = None) -> str:
    """A streamed answer as it came; ``tell``'s stream is broken once the client holds
    its ``die_after`` events."""
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = ""
        async for piece in r.content.iter_any():
            raw += piece.decode()
            if tell is not None and raw.count("data: {") >= tell.die_after:
                tell.die.set()
    return raw


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 tell: StreamingDecode | None = None) -> list[dict[str, Any]]:
    raw = await raw_stream(s, url, body, tell)
    assert raw.endswith("data: [DONE]\n\n"), raw
    events = [json.loads(line[6:]) for line in raw.split("\n\n")
              if line.startswith("data: {")]
    assert not [e for e in events if "error" in e], raw
    return events


def ids_of(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]


def words_of(events: list[dict[str, Any]]) -> list[int]:
    return [int(w[1:]) for e in events for c in e["choices"] for w in c["text"].split()]


@pytest.mark.parametrize("client_ids", [True, False])
def test_a_decode_dying_mid_stream_is_resumed_on_another_with_the_same_tokens(client_ids):
    first = StreamingDecode("decode", name="first", die_after=3)
    second = StreamingDecode("decode", name="second")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": True, "seed": 7, "stream_options": {"include_usage": True}}
    if client_ids:
        body["return_token_ids"] = True

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[1].work = 10**6  # the dying instance is the first choice
        events = await stream(s, url, body, tell=first)
        expect = greedy(PROMPT, 8)
        assert words_of(events) == expect  # every token once, in order
        assert (ids_of(events) == expect) if client_ids else ids_of(events) == []
        assert all("prompt_token_ids" not in c for e in events[1:] for c in e["choices"])
        assert {e["id"] for e in events} == {"cmpl-first"}  # one answer, one id
        assert {e["created"] for e in events} == {1}
        assert first.legs[0].body["return_token_ids"] is True
        assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 8,
                                       "total_tokens": 12}
        (leg,) = second.legs
        assert leg.body["prompt"] == PROMPT + expect[:3] and leg.body["max_tokens"] == 5
        assert leg.body["seed"] == 7 and leg.body["temperature"] == 0
        assert await counter(s, url, "pushkv_proxy_failover_causes_total",
                             stage="mid_stream", cause="gone") == 1
        assert await counter(s, url, "pushkv_proxy_failover_prompt_tokens_total",
                             stage="mid_stream") == 7
        assert await counter(s, url, "pushkv_proxy_resume_seconds_count") == 1
        assert not proxy.decode[0].up  # found gone

    run([FakeVllm("prefill")], [first, second], scenario, health=SLOW_PROBES)


def test_a_stream_cut_while_its_instance_stays_healthy_ends_with_an_error_event():
    """The poison rule holds mid-stream: a healthy engine that broke a stream off is
    not asked to resume it elsewhere."""
    first = StreamingDecode("decode", die_after=2, stays_healthy=True)
    second = StreamingDecode("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[1].work = 10**6
        raw = await raw_stream(s, url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                        "stream": True}, tell=first)
        assert '"error"' in raw and raw.endswith("data: [DONE]\n\n")
        assert second.legs == []

    run([FakeVllm("prefill")], [first, second], scenario, health=SLOW_PROBES)


def test_resumes_zero_ends_the_stream_with_an_error_event_as_before():
    first, second = StreamingDecode("decode", die_after=2), StreamingDecode("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[1].work = 10**6
        raw = await raw_stream(s, url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                        "stream": True}, tell=first)
        assert '"error"' in raw and second.legs == []
        assert "return_token_ids" not in first.legs[0].body  # nothing added when off

    run([FakeVllm("prefill")], [first, second], scenario, health=SLOW_PROBES, resumes=0)


def test_a_drained_decode_gets_no_new_leg_and_its_waiting_stream_moves():
    waiting, other = StreamingDecode("decode"), StreamingDecode("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        target = proxy.decode[0].url
        proxy.decode[1].work = 10**6
        task = asyncio.create_task(stream(s, url, {"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 4, "stream": True}))
        await until(lambda: len(waiting.legs) == 1)
        async with s.post(url + "/admin/drain", params={"instance": target}) as r:
            assert r.status == 200 and (await r.json())["drained"] is True
        events = await task
        assert words_of(events) == greedy(PROMPT, 4) and len(other.legs) == 1
        assert await counter(s, url, "pushkv_proxy_failover_causes_total",
                             stage="before_answer", cause="drained") == 1
        async with s.get(url + "/health") as r:
            assert (await r.json())["drained"] == [target]
        text = await (await s.get(url + "/metrics")).text()
        assert metric(text, "pushkv_proxy_instance_drained", url=target) == 1
        await stream(s, url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                              "stream": True})
        assert len(waiting.legs) == 1  # nothing new while drained
        async with s.post(url + "/admin/undrain", params={"instance": target}) as r:
            assert r.status == 200 and (await r.json())["drained"] is False
        assert proxy.decode[0].serving

    # Its legs wait forever: a queue that does not move.
    waiting.completions = _hanging(waiting)  # type: ignore[method-assign]
    run([FakeVllm("prefill")], [waiting, other], scenario, health=SLOW_PROBES)


def _hanging(fake: FakeVllm) -> Any:
    original = FakeVllm.completions

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params")
        if params and params.get("pushkv_discover"):
            return await original(fake, request)
        fake.legs.append(_leg(body, request))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")
    return completions


@pytest.mark.parametrize(("query", "status"), [("", 400), ("?instance=http://nowhere:1", 404)])
def test_a_bad_drain_call_is_refused_and_changes_nothing(query, status):
    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        async with s.post(url + "/admin/drain" + query) as r:
            body = await r.json()
        assert r.status == status and body["error"]["code"] == status
        assert body["error"]["param"] == "instance"
        assert all(i.serving for i in proxy.pool.all)
        text = await (await s.get(url + "/metrics")).text()
        assert metric(text, "pushkv_proxy_instance_drained") == 0

    run([FakeVllm("prefill")], [FakeVllm("decode")], scenario, health=FAST)


def test_a_bad_policy_is_refused_and_retarget_is_accepted(capsys):
    assert ProxySettings(failover=RETARGET).failover == RETARGET
    with pytest.raises(ValueError, match="not one of"):
        ProxySettings(failover="hope")
    import argparse

    parser = argparse.ArgumentParser()
    proxy_cli.register(parser.add_subparsers())
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                           "--failover", "hope"])
    assert exit_.value.code == 2 and "hope" in capsys.readouterr().err
    assert ProxySettings(bind="late").bind == "late"
    with pytest.raises(ValueError, match="bind must be one of arrival, late"):
        ProxySettings(bind="soon")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                           "--bind", "soon"])
    assert exit_.value.code == 2 and "soon" in capsys.readouterr().err
    args = parser.parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2",
                              "--bind", "late"])
    assert args.bind == "late"


def test_continuation_carries_the_prompt_and_tokens_and_refuses_what_it_cannot():
    tap = Tap(client_ids=True)
    tap.begin()
    first = {"id": "a", "choices": [{"token_ids": [7], "prompt_token_ids": [1, 2]}]}
    second = {"id": "a", "choices": [{"token_ids": [8]}]}
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (first, second))
    # Cut inside the second event: only whole events are written.
    assert tap.feed(raw[:-5], 0.0) == raw[: raw.index(b"\n\n") + 2]
    assert tap.feed(raw[-5:], 0.0) == raw[raw.index(b"\n\n") + 2:]
    body = {"prompt": [1, 2], "max_tokens": 5, "min_tokens": 1, "echo": True, "seed": 3}
    nxt = continuation(body, "/v1/completions", tap)
    assert nxt == {"prompt": [1, 2, 7, 8], "max_tokens": 3, "min_tokens": 0, "seed": 3,
                   "return_token_ids": True}
    with pytest.raises(NotResumable, match="chat"):
        continuation(body, "/v1/chat/completions", tap)
    blind = Tap(client_ids=True)
    blind.begin()
    blind.feed(b'data: {"choices": [{"text": "x"}]}\n\n', 0.0)
    with pytest.raises(NotResumable, match="prompt token ids"):
        continuation(body, "/v1/completions", blind)


def test_the_drill_spreads_its_kills_and_counts_what_clients_saw():
    import random

    from pushkv.fit.e2e.failover import DrillReport, DrillSettings, kill_points
    from pushkv.vllm.chaos import Outcome

    points = kill_points(1000, 10, random.Random(3))
    share = 1000 / 11
    assert len(points) == 10 and points == sorted(points)
    assert all(abs(p - share * (i + 1)) <= share / 4 for i, p in enumerate(points))
    with pytest.raises(ValueError, match="fewer than requests"):
        DrillSettings(requests=5, kills=5)
    report = DrillReport(
        outcomes=[Outcome("correct"), Outcome("wrong"), Outcome("clear_error"),
                  Outcome("hung"), Outcome("correct")],
        kills=2, prompt_tokens=1000,
        proxy={"failovers": 3, "before_answer": 2, "mid_stream": 1,
               "prompt_tokens_before_answer": 50, "prompt_tokens_mid_stream": 70},
        resume_gaps_ms=[120.0],
        prefill_tokens={"local_compute": 1030.0, "local_cache_hit": 64.0})
    fig = report.figures()
    assert (fig["client_errors"], fig["wrong_tokens"], fig["failovers"]) == (2, 1, 3)
    assert fig["prompt_recompute_share"] == 0.05 and fig["resume_p99_ms"] == 120.0
    assert fig["prefill_excess_share"] == 0.03
    with pytest.raises(ValueError, match="retry or retarget"):
        DrillSettings(failover="again")


def test_a_decode_shutting_down_503_and_unhealthy_is_left_for_another():
    """A decode instance going away (SIGTERM) answers 503 and fails its health check:
    the request goes to the other one, no client error; a 503 from an instance that
    stays healthy is passed on as before (test_proxy_failover)."""
    closing = FakeVllm("decode", status=503, healthy=False)
    other = StreamingDecode("decode")

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.decode[1].work = 10**6  # the closing instance is the first choice
        events = await stream(s, url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                       "stream": True})
        assert words_of(events) == greedy(PROMPT, 3)
        assert len(closing.legs) == 1 and len(other.legs) == 1
        assert not proxy.decode[0].up
        assert await counter(s, url, "pushkv_proxy_failover_causes_total",
                             stage="before_answer", cause="gone") == 1

    run([FakeVllm("prefill")], [closing, other], scenario, health=SLOW_PROBES)


def test_with_no_instance_left_to_take_over_the_client_is_told_its_instance_went_away():
    only = StreamingDecode("decode", name="only", die_after=2)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        raw = await raw_stream(s, url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                                        "stream": True}, tell=only)
        (error,) = [json.loads(line[6:])["error"] for line in raw.split("\n\n")
                    if line.startswith('data: {"error"')]
        assert "went away while serving this request" in error["message"]
        assert "not sent to another" not in error["message"]

    run([FakeVllm("prefill")], [only], scenario, health=SLOW_PROBES)
