"""Failover on real vLLM CPU servers behind ``pushkv proxy``: 2 prefill, 3 decode.

The servers serve the tiny model with its word tokenizer (word ``w<i>`` is token
``i``), so a streamed answer's text names its tokens. References are the same
prompts served uninterrupted through the same proxy first (equal to a plain
server's greedy output: test_e2e.py), or served plainly (no transfer) by a prefill
instance that takes no part in the test, so that the prefill instances' counts of
prompt tokens computed are the test's alone.

* A decode instance is killed (``SIGKILL`` of its process group) while it streams
  an answer and generates a non-streamed one: both go on on the other decode
  instance (the prompt plus the tokens generated as the new prompt); the stream's
  client sees the uninterrupted text, every token once, no error, and the
  non-streamed one gets one body, exactly a plain server's (the proxy asked the
  decode instance for a stream and assembled it). The prefill instance computes
  only what the two resumes add beyond its prefix cache.
* A decode instance is drained while streams run on both: every stream finishes,
  and no new request reaches the drained instance.
* ``--failover retarget``, a decode instance lost before the client's first token,
  at each moment of the handoff: frozen before it registered and thawed later
  (d); and, with one
  ``SIGKILL``, three requests at once -- one it had not registered (a), one it had
  registered while its producer was held (b), one whose KV its producer had
  written whole and keeps until the decode engine's first step (c), over two
  prefill instances. Every answer is complete and exact; the prefill instances'
  vLLM counters show each prompt computed once.

Waits poll state with generous deadlines; nothing sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv import timeline
from pushkv.audit import audit
from pushkv.vllm.chaos import FAST, STARTUP_S, Fleet, prompt, wait_for
from pushkv.vllm.testing import get_text, metric, post_json, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

#: decode-1 dies mid-stream, decode-3 before the first token: one each, no restart.
NAMES = ("prefill-1", "prefill-2", "decode-1", "decode-2", "decode-3")
#: Every instance records its protocol steps here (the waits and the audit read them).
TIMELINE = "timeline"
#: How long a producer holds a source for a re-target (rule 12): after its consumer
#: engine died, and after writing it until that engine's first decode step.
HOLD_S = 20.0
#: The decode instance whose engine the test pauses (its transport still runs).
PAUSED = "decode-3"
LONG = 180  #: tokens of an answer a kill lands in the middle of
WHOLE = 210  #: tokens of the non-streamed one (it starts first)
SHORT = 24


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(str(tiny_model), tmp_path_factory.mktemp("failover-logs"))
    for name, cpu in zip(NAMES, (0, 1, 1, 0, 1), strict=True):
        role = name.split("-")[0]
        hold = {"retarget_hold_s": HOLD_S} if role == "prefill" else {}
        spec = f.add(name, role, cpu, timeline_dir=str(f.logs / TIMELINE), **hold).spec
        spec.tokenizer = True
        if name == PAUSED:  # vLLM's /pause (its development endpoints)
            spec.env = {**spec.env, "VLLM_SERVER_DEV_MODE": "1"}
    try:
        f.start(*NAMES, timeout_s=STARTUP_S)
        yield f
    finally:
        f.stop()


@contextlib.contextmanager
def proxy(f: Fleet, prefill: Sequence[str], *flags: str,
          decode: Sequence[str] = ("decode-1", "decode-2")) -> Iterator[str]:
    """A proxy of the test's own over the named instances (closed at its end, so that
    no other proxy's probes or discovery requests reach the instances meanwhile)."""
    url = f.proxy(list(prefill), list(decode), *flags, timeout_s=120)
    try:
        yield url
    finally:
        f.close_proxy(url)


def body(model: str, tokens: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


def answer(url: str, model: str, tokens: list[int], max_tokens: int) -> list[int]:
    status, got = post_json(url + "/v1/completions",
                            body(model, tokens, max_tokens, return_token_ids=True), timeout=120)
    assert status == 200, got
    return list(got["choices"][0]["token_ids"])


class Stream(threading.Thread):
    """A streamed completion read event by event; ``first`` is set at its first event."""

    def __init__(self, url: str, payload: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.first = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(self.payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=180) as resp:
                lines = []
                for line in resp:
                    lines.append(line)
                    if line.strip() == b"data: [DONE]":
                        self.done = True
                    for event in sse_events([line]):
                        self.events.append(event)
                        self.first.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first.set()

    def words(self) -> list[int]:
        assert self.error is None and self.done, (self.error, self.events[-2:])
        assert not [e for e in self.events if "error" in e], self.events
        return [int(w[1:]) for e in self.events for c in e["choices"]
                for w in c.get("text", "").split()]


def proxy_metric(base: str, name: str, **labels: str) -> float:
    return metric(get_text(base + "/metrics"), name, **labels)


def pause(url: str) -> None:
    """Stop an instance's engine from stepping, requests kept (vLLM's ``/pause`` in
    ``keep`` mode): it takes no step, while its connector's transport threads run."""
    status, got = post_json(f"{url}/pause?mode=keep&clear_cache=false", {})
    assert status == 200 and got == {"status": "paused"}, (status, got)


def admin(url: str, call: str, inst: str) -> dict[str, Any]:
    status, got = post_json(f"{url}/admin/{call}?instance={inst}", {})
    assert status == 200, got
    return dict(got)


def test_a_drain_moves_new_requests_away_and_running_streams_finish(fleet):
    with proxy(fleet, ["prefill-1"]) as url:
        drain_moves_new_requests_away(fleet, url)


def drain_moves_new_requests_away(f: Fleet, url: str) -> None:
    prompts = [prompt(20 + 7 * i, 9100 + i) for i in range(4)]
    refs = [answer(url, f.model, p, SHORT * 3) for p in prompts]
    d1 = f.instances["decode-1"].url
    streams = [Stream(url, body(f.model, p, SHORT * 3, stream=True)) for p in prompts]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120)
    assert admin(url, "drain", d1)["drained"] is True
    for s, ref in zip(streams, refs, strict=True):
        s.join(180)
        assert s.words() == ref
    served = f.counter("decode-1", "vllm:request_success_total")
    for i in range(2):
        tokens = prompt(30, 9200 + i)
        assert len(answer(url, f.model, tokens, SHORT)) == SHORT
    assert f.counter("decode-1", "vllm:request_success_total") == served
    assert admin(url, "undrain", d1)["drained"] is False


def plain(f: Fleet, name: str, tokens: list[int], max_tokens: int) -> list[int]:
    """The greedy answer of instance ``name`` computing the prompt itself (no transfer)."""
    status, got = post_json(f.instances[name].url + "/v1/completions",
                            body(f.model, tokens, max_tokens, return_token_ids=True),
                            timeout=120)
    assert status == 200, got
    return list(got["choices"][0]["token_ids"])


def steps(f: Fleet, name: str, event: str) -> int:
    """How many ``event`` marks instance ``name``'s processes recorded (all its lives)."""
    return sum(1 for m in timeline.read(f.logs / TIMELINE)
               if m.event == event and m.process.startswith(name + "-"))


def computed(f: Fleet, name: str) -> tuple[float, float]:
    """Prompt tokens instance ``name`` computed, and found in its prefix cache, so far."""
    text = get_text(f.instances[name].url + "/metrics")
    return tuple(metric(text, "vllm:prompt_tokens_by_source_total", source=s)  # type: ignore
                 for s in ("local_compute", "local_cache_hit"))


def since(f: Fleet, name: str, before: tuple[float, float]) -> tuple[float, float]:
    now = computed(f, name)
    return now[0] - before[0], now[1] - before[1]


def counted(f: Fleet, name: str, before: tuple[float, float],
            expect: tuple[int, int]) -> None:
    """Wait until instance ``name`` counts ``expect`` (computed, from its prefix cache)
    prompt tokens since ``before`` (vLLM publishes its counts a moment after a step)."""
    seen: list[tuple[float, float]] = []
    wait_for(lambda: seen.append(since(f, name, before)) or seen[-1] == expect, 30,
             lambda: f"{name} computed and found {expect} prompt tokens: saw {seen[-1:]}")


def outcomes(f: Fleet, name: str) -> float:
    """Transfers a consumer instance's connector has seen to an end or registered."""
    text = get_text(f.instances[name].url + "/metrics")
    return sum(metric(text, f"pushkv:transfers_{k}_total")
               for k in ("registered", "abandoned", "failed", "cancelled"))


class Call(threading.Thread):
    """A non-streamed completion through the proxy, answered in ``status``/``answer``."""

    def __init__(self, url: str, model: str, tokens: list[int], max_tokens: int,
                 **kw: Any) -> None:
        super().__init__(daemon=True)
        self.args = (url + "/v1/completions",
                     body(model, tokens, max_tokens, return_token_ids=True, **kw))
        self.status, self.answer = 0, None
        self.start()

    def run(self) -> None:
        self.status, self.answer = post_json(*self.args, timeout=180)

    def tokens(self) -> list[int]:
        self.join(180)
        assert self.status == 200, (self.status, self.answer)
        return list(self.answer["choices"][0]["token_ids"])


def test_d_a_frozen_decode_is_passed_over_and_thawed_gets_nothing_of_its_old_attempt(fleet):
    """(d) The decode instance is frozen (SIGSTOP) before the request reaches its engine;
    its probes fail, the same decode leg goes to the other instance at turn 1 and the
    answer is exact, the prompt computed once. Thawed, the old instance reads the old
    request (its client long gone) and its connector ends it without a byte of the
    old attempt: its next transfer receives exactly its own blocks, and it answers
    exactly."""
    f = fleet
    tokens, fresh = prompt(40, 9500), prompt(40, 9501)
    ref, ref_fresh = plain(f, "prefill-2", tokens, SHORT), plain(f, "prefill-2", fresh, SHORT)
    victim, other = f.instances["decode-1"], f.instances["decode-2"]
    with proxy(f, ["prefill-1"], "--failover", "retarget") as url:
        before, ended = computed(f, "prefill-1"), outcomes(f, "decode-1")
        admin(url, "drain", other.url)
        f.freeze("decode-1")
        call = Call(url, f.model, tokens, SHORT)
        wait_for(lambda: proxy_metric(url, "pushkv_proxy_instance_outstanding",
                                      url=victim.url) >= 1, 60, "the leg sent to the frozen one")
        admin(url, "undrain", other.url)
        assert call.tokens() == ref
        assert proxy_metric(url, "pushkv_proxy_failover_causes_total",
                            cause="out_of_rotation") == 1
        counted(f, "prefill-1", before, (len(tokens), 0))
        f.thaw("decode-1")
        wait_for(lambda: outcomes(f, "decode-1") > ended, 120,
                 "the thawed instance ended the old request")
        wait_for(lambda: f.in_rotation(url, "decode-1"), 120, "decode-1 back in rotation")
        received = f.counter("decode-1", "pushkv:blocks_received_total")
        admin(url, "drain", other.url)
        assert Call(url, f.model, fresh, SHORT).tokens() == ref_fresh
        admin(url, "undrain", other.url)
        # the fresh prompt's two blocks, nothing else (vLLM counts them at its next step)
        wait_for(lambda: f.counter("decode-1", "pushkv:blocks_received_total") >= received + 2,
                 60, "decode-1 counted the fresh transfer's blocks")
        assert f.counter("decode-1", "pushkv:blocks_received_total") == received + 2
        f.wait_idle()


def test_a_decode_killed_mid_stream_is_resumed_and_the_client_sees_no_break(fleet):
    with proxy(fleet, ["prefill-1"]) as url:
        killed_mid_stream(fleet, url)


def killed_mid_stream(f: Fleet, url: str) -> None:
    streamed, whole = prompt(40, 9300), prompt(40, 9301)  # 40: one full block cached
    # The references go through the proxy: non-streamed, so assembled from a stream,
    # and equal to a plain server's non-streamed body (prefill-2 computes it alone).
    assembled = proxy_metric(url, "pushkv_proxy_assembled_total", outcome="ok")
    ref_stream, ref_whole = answer(url, f.model, streamed, LONG), answer(url, f.model, whole,
                                                                          WHOLE)
    status, mine = post_json(url + "/v1/completions",
                             body(f.model, whole, WHOLE, return_token_ids=True), timeout=120)
    status_plain, theirs = post_json(f.instances["prefill-2"].url + "/v1/completions",
                                     body(f.model, whole, WHOLE, return_token_ids=True),
                                     timeout=120)
    assert status == status_plain == 200, (mine, theirs)
    assert mine.keys() == theirs.keys() and mine["object"] == theirs["object"]
    (c_mine,), (c_theirs,) = mine["choices"], theirs["choices"]
    assert c_mine.keys() == c_theirs.keys()
    for key in ("text", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids"):
        assert c_mine[key] == c_theirs[key], key
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert mine["usage"][key] == theirs["usage"][key], key
    assert proxy_metric(url, "pushkv_proxy_assembled_total", outcome="ok") == assembled + 3
    victim, other = f.instances["decode-1"], f.instances["decode-2"]
    admin(url, "drain", other.url)  # both requests go to the victim
    before = computed(f, "prefill-1")  # both prompts' full block is in its prefix cache
    generated = f.counter("decode-1", "vllm:generation_tokens_total")
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(whole=post_json(
        url + "/v1/completions", body(f.model, whole, WHOLE), timeout=180)), daemon=True)
    waiter.start()
    wait_for(lambda: f.counter("decode-1", "vllm:generation_tokens_total") > generated, 60,
             "the non-streamed answer's first token generated")
    s = Stream(url, body(f.model, streamed, LONG, stream=True))
    s.start()
    assert s.first.wait(120) and s.error is None
    proc = victim.server.proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGSTOP)  # no token more from it...
    admin(url, "undrain", other.url)
    f.kill("decode-1")  # ...and then it is gone
    s.join(180)
    waiter.join(180)
    assert s.words() == ref_stream  # every token once, in order, no error
    assert not any("token_ids" in c for e in s.events for c in e["choices"])
    status, whole_answer = got["whole"]
    assert status == 200, whole_answer
    (choice,) = whole_answer["choices"]
    assert [int(w[1:]) for w in choice["text"].split()] == ref_whole
    assert choice["token_ids"] is None and choice["finish_reason"] == "length"
    assert whole_answer["usage"]["completion_tokens"] == WHOLE
    assert whole_answer["usage"]["prompt_tokens"] == len(whole)
    # Both were resumed (none re-targeted or sent again whole), each with its gap.
    assert proxy_metric(url, "pushkv_proxy_failover_causes_total", stage="mid_stream") == 2
    assert proxy_metric(url, "pushkv_proxy_failover_causes_total", stage="before_answer") == 0
    assert proxy_metric(url, "pushkv_proxy_resume_seconds_count") == 2
    # Each continuation's prompt is the prompt plus the k tokens generated: its full
    # block (32) from the prefix cache, the rest computed; each first leg computed its
    # last 8 tokens. Nothing else reached prefill-1.
    resent = int(proxy_metric(url, "pushkv_proxy_failover_prompt_tokens_total",
                              stage="mid_stream"))
    counted(f, "prefill-1", before, (8 + 8 + resent - 64, 32 * 4))


def test_abc_one_decode_killed_at_three_moments_before_the_first_token(fleet):
    """``--failover retarget``, 2 prefill and 2 decode instances, one SIGKILL of decode-3
    while it holds three requests, each at another moment (non-streamed: the client has
    no token of any):

    (a) y: the leg reached decode-3 after its engine was paused: never registered;
    (b) x: decode-3 registered x with prefill-1, which was held (SIGSTOP) and had
        written nothing (the Register waits in its socket; thawed after the kill);
    (c) z: prefill-2 had written z's whole KV into decode-3, whose engine was
        paused (vLLM's /pause, requests kept: no step, while its transport takes
        the write) before it saw READY -- prefill-2 is held until then -- so
        before its first decode step: prefill-2 keeps the source
        (retarget_hold_s) until a first decode step reports it consumed. (A
        frozen decode-3 would not do: the write into it completes only with its
        transport running.)

    x, y and z go to decode-2 as the same transfers at turn 1 and their prefill
    instances write the KV they held: each prompt is computed once, nothing from a
    prefix cache, and nothing is sent again as a new transfer. Every answer is
    exact; no error reaches a client.
    """
    f = fleet
    x, y, z = prompt(40, 9600), prompt(40, 9601), prompt(40, 9602)
    # references from the prefill instance that does not serve the prompt
    ref = {"x": plain(f, "prefill-2", x, SHORT), "y": plain(f, "prefill-2", y, SHORT),
           "z": plain(f, "prefill-1", z, LONG)}
    p1, p2 = f.instances["prefill-1"].url, f.instances["prefill-2"].url
    d3, d2 = f.instances["decode-3"].url, f.instances["decode-2"].url
    # probes never take an instance out here: a frozen prefill instance stays in, and the kill
    # is seen on the legs themselves (connections reset, /health refused)
    with proxy(f, ["prefill-1", "prefill-2"], "--failover", "retarget",
               "--unhealthy-after", "100000", decode=("decode-3", "decode-2")) as url:
        admin(url, "drain", d2)
        for n, b in enumerate((p2, p1)):  # decode-3 handshakes with both producers
            admin(url, "drain", b)
            tokens = prompt(20, 9610 + n)
            assert Call(url, f.model, tokens, 4).tokens() == plain(f, "prefill-2", tokens, 4)
            admin(url, "undrain", b)
        before = {p: computed(f, p) for p in ("prefill-1", "prefill-2")}
        causes = proxy_metric(url, "pushkv_proxy_failover_causes_total")
        consumed = steps(f, "decode-3", "consumed_sent")
        # (b) x: registered at decode-3, prefill-1 held
        admin(url, "drain", p2)
        f.freeze("prefill-1")
        regs = steps(f, "decode-3", "registration_sent")
        cx = Call(url, f.model, x, SHORT)
        wait_for(lambda: steps(f, "decode-3", "registration_sent") > regs, 60,
                 "decode-3 sent x's registration")
        # (c) z: prefill-2 writes all of it into decode-3, paused before it saw READY
        admin(url, "undrain", p2)
        admin(url, "drain", p1)
        regs, written = (steps(f, "decode-3", "registration_sent"),
                         steps(f, "prefill-2", "write_completed"))
        f.freeze("prefill-2")  # so that z's KV cannot land before decode-3 is paused
        cz = Call(url, f.model, z, LONG)
        wait_for(lambda: steps(f, "decode-3", "registration_sent") > regs, 60,
                 "decode-3 sent z's registration")
        pause(d3)
        f.thaw("prefill-2")
        wait_for(lambda: steps(f, "prefill-2", "write_completed") > written, 60,
                 "prefill-2 wrote z (its source kept: decode-3 took no step of it)")
        assert steps(f, "decode-3", "consumed_sent") == consumed
        # (a) y: sent to the paused decode-3
        admin(url, "undrain", p1)
        admin(url, "drain", p2)
        cy = Call(url, f.model, y, SHORT)
        wait_for(lambda: proxy_metric(url, "pushkv_proxy_instance_outstanding", url=d3) >= 3,
                 60, "y's leg sent to decode-3")
        admin(url, "undrain", p2)
        admin(url, "undrain", d2)
        f.kill("decode-3")
        f.thaw("prefill-1")
        for name, call in (("x", cx), ("y", cy), ("z", cz)):
            assert call.tokens() == ref[name], name
        counted(f, "prefill-1", before["prefill-1"], (len(x) + len(y), 0))
        # z had no token and decode-3 no step of it: re-targeted at turn 1, prefill-2
        # writes the source it kept into decode-2; the prompt computed once, no reissue
        counted(f, "prefill-2", before["prefill-2"], (len(z), 0))
        assert proxy_metric(url, "pushkv_proxy_failover_prompt_tokens_total") == 0
        assert proxy_metric(url, "pushkv_proxy_failover_causes_total") == causes + 3
        assert proxy_metric(url, "pushkv_proxy_failover_causes_total",
                            cause="source_released") == 0
        f.wait_idle()


def test_every_transfer_of_the_failovers_passes_the_audit(fleet):
    """The protocol steps every instance recorded through the kills, freezes and
    re-targets break no promise (python -m pushkv.audit): no write into a block not
    lent to its attempt, every source released once, nothing left lent or held."""
    fleet.wait_idle()
    report = audit(fleet.logs / TIMELINE, grace_s=FAST["fence_grace_s"])
    assert report.run.uses, report.summary()
    assert report.clean, "\n".join(report.lines())
