"""Failover on real vLLM CPU servers behind ``pushkv proxy``: 1 prefill, 2 decode.

The servers serve the tiny model with its word tokenizer (word ``w<i>`` is token
``i``), so a streamed answer's text names its tokens. References are the same
prompts served uninterrupted through the same proxy first (equal to a plain
server's greedy output: test_e2e.py).

* A decode instance is killed (``SIGKILL`` of its process group) while it streams
  an answer and serves a non-streamed one: the stream goes on on the other decode
  instance (the prompt plus the tokens streamed as the new prompt) and the client
  sees the uninterrupted text, every token once, no error; the non-streamed one
  is retried as a new transfer and answered whole.
* A decode instance is drained while streams run on both: every stream finishes,
  and no new request reaches the drained instance.

Waits poll state with generous deadlines; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.vllm.chaos import STARTUP_S, Fleet, prompt, wait_for
from pushkv.vllm.testing import get_text, metric, post_json, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

NAMES = ("prefill-1", "decode-1", "decode-2")
LONG = 180  #: tokens of an answer a kill lands in the middle of
SHORT = 24


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Fleet, str]]:
    f = Fleet(str(tiny_model), tmp_path_factory.mktemp("failover-logs"))
    for name, cpu in zip(NAMES, (0, 1, 0), strict=True):
        f.add(name, name.split("-")[0], cpu).spec.tokenizer = True
    try:
        f.start(*NAMES, timeout_s=STARTUP_S)
        url = f.proxy(["prefill-1"], ["decode-1", "decode-2"], timeout_s=120)
        yield f, url
    finally:
        f.stop()


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


def admin(url: str, call: str, inst: str) -> dict[str, Any]:
    status, got = post_json(f"{url}/admin/{call}?instance={inst}", {})
    assert status == 200, got
    return dict(got)


def test_a_drain_moves_new_requests_away_and_running_streams_finish(fleet):
    f, url = fleet
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


def test_a_decode_killed_mid_stream_is_resumed_and_the_client_sees_no_break(fleet):
    f, url = fleet
    streamed, whole = prompt(40, 9300), prompt(23, 9301)  # 40: one full block cached
    ref_stream, ref_whole = answer(url, f.model, streamed, LONG), answer(url, f.model, whole,
                                                                          LONG)
    victim, other = f.instances["decode-1"], f.instances["decode-2"]
    admin(url, "drain", other.url)  # both requests go to the victim
    hits = f.counter("prefill-1", "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(whole=post_json(
        url + "/v1/completions", body(f.model, whole, LONG, return_token_ids=True),
        timeout=180)), daemon=True)
    waiter.start()
    wait_for(lambda: proxy_metric(url, "pushkv_proxy_instance_outstanding",
                                  url=victim.url) >= 1, 60, "the whole answer's leg sent")
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
    assert status == 200 and whole_answer["choices"][0]["token_ids"] == ref_whole
    assert proxy_metric(url, "pushkv_proxy_failover_causes_total", stage="mid_stream") == 1
    assert proxy_metric(url, "pushkv_proxy_resume_seconds_count") == 1
    # The stream's first prefill and its continuation's each found the prompt's full
    # block (32 tokens) in the prefill instance's prefix cache.
    assert f.counter("prefill-1", "vllm:prompt_tokens_by_source_total",
                     source="local_cache_hit") >= hits + 64
