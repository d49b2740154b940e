"""The non-streamed body ``pushkv proxy`` assembles from a streamed decode leg's events
(pushkv.vllm.proxy.assemble), and the tap that keeps them across a resume."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pushkv.vllm.proxy.assemble import AssemblyError, assemble, events, streamed, why_not
from pushkv.vllm.proxy.input import CHAT, COMPLETIONS
from pushkv.vllm.proxy.resume import Tap, continuation

HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}


def ev(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode())


def chunk(text: str, ids: list[int], finish: str | None = None, stop: Any = None,
          prompt: list[int] | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish, "stop_reason": stop, "token_ids": ids}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return ev({**HEAD, "choices": [choice]})


USAGE = {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}
STREAM = [chunk(" w4", [4], prompt=[1, 2, 3]), chunk(" w5", [5]),
          chunk(" w6", [6], finish="length"), ev({**HEAD, "choices": [], "usage": USAGE}),
          ev(b"[DONE]")]


def test_a_stream_becomes_the_body_vllm_gives_for_the_same_request():
    got = assemble(STREAM)
    assert got == {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "text": " w4 w5 w6", "logprobs": None,
                     "finish_reason": "length", "stop_reason": None, "token_ids": [4, 5, 6],
                     "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3],
                     "routed_experts": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {**USAGE, "prompt_tokens_details": None, "completion_tokens_details": None},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def test_a_stop_token_and_the_servers_prompt_details_are_kept():
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 32}}
    got = assemble([chunk("a", [4]), chunk("", [2], finish="stop", stop=2),
                    ev({**HEAD, "choices": [], "usage": usage}), ev(b"[DONE]")])
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["choices"][0]["stop_reason"] == 2
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


BAD = {
    "no [DONE]": STREAM[:-1],
    "no finish reason": [STREAM[0], STREAM[1], STREAM[3], STREAM[4]],
    "no usage": [*STREAM[:3], STREAM[4]],
    "an event after [DONE]": [*STREAM, STREAM[1]],
    "not JSON": [STREAM[0], ev(b"{broken"), *STREAM[2:]],
    "not an object": [STREAM[0], ev([1, 2]), *STREAM[2:]],
    "no data line": [STREAM[0], b": keep-alive", *STREAM[2:]],
    "a second choice": [STREAM[0], ev({**HEAD, "choices": [
        {"index": 1, "text": "x", "finish_reason": None}]}), *STREAM[2:]],
    "a choice after the finish": [*STREAM[:3], STREAM[1], *STREAM[3:]],
    "text not a string": [ev({**HEAD, "choices": [{"index": 0, "text": 5}]}), *STREAM[1:]],
    "bad token ids": [chunk("a", ["x"]), *STREAM[1:]],  # type: ignore[list-item]
    "prompt ids twice": [STREAM[0], chunk(" w5", [5], prompt=[1]), *STREAM[2:]],
    "usage before the finish": [STREAM[0], STREAM[3], *STREAM[1:3], STREAM[4]],
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_stream_that_is_not_one_complete_answer_is_a_typed_error(name):
    with pytest.raises(AssemblyError) as err:
        assemble(BAD[name])
    assert err.value.error is None and str(err.value)


def test_an_error_event_carries_the_engines_error():
    error = {"message": "boom", "type": "InternalServerError", "code": 500}
    with pytest.raises(AssemblyError) as err:
        assemble([STREAM[0], ev({"error": error}), ev(b"[DONE]")])
    assert err.value.error == error


def test_a_broken_stream_after_its_last_token_takes_the_usage_given():
    got = assemble([*STREAM[:3], ev(b"[DONE]")], usage=USAGE)
    assert got["usage"]["total_tokens"] == 6


def test_what_is_passed_through_non_streamed_and_what_the_decode_leg_is_asked():
    base = {"model": "m", "prompt": [1, 2], "max_tokens": 4}
    assert why_not(base, COMPLETIONS) == ""
    assert why_not(dict(base, return_token_ids=True, stop=["x"]), COMPLETIONS) == ""
    assert why_not(base, CHAT)
    for key, value in (("echo", True), ("logprobs", 0), ("prompt_logprobs", 1),
                       ("stream_options", {"include_usage": False})):
        assert key in why_not(dict(base, **{key: value}), COMPLETIONS)
    assert streamed(base) == dict(base, stream=True, stream_options={"include_usage": True})


@pytest.mark.parametrize("client_ids", [False, True])
def test_a_resumed_answer_assembles_to_the_uninterrupted_one(client_ids):
    """The tap's events of a leg broken after 2 tokens and of its continuation (the
    prompt plus those 2 as its prompt, max_tokens 3 less 2) assemble to the body of the
    uninterrupted stream, fed in pieces cut anywhere; nothing is assembled twice."""
    whole = b"".join(e + b"\n\n" for e in STREAM)
    second = b"".join(e + b"\n\n" for e in (
        ev({**HEAD, "id": "cmpl-2", "created": 9, "choices": [
            {"index": 0, "text": " w6", "finish_reason": "length", "stop_reason": None,
             "token_ids": [6], "prompt_token_ids": [1, 2, 3, 4, 5]}]}),
        ev({**HEAD, "id": "cmpl-2", "choices": [],
            "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1}}),
        ev(b"[DONE]")))
    tap = Tap(client_ids=client_ids)
    kept: list[bytes] = []
    tap.begin()
    first = whole[: whole.index(b"data: {", whole.index(b" w5"))]  # broken after w5 + a bit
    cut = first + b'data: {"id": "cmp'
    for i in range(0, len(cut), 7):
        kept += events(tap.feed(cut[i:i + 7], 0.0))
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}
    nxt = continuation(body, COMPLETIONS, tap)
    assert nxt["prompt"] == [1, 2, 3, 4, 5] and nxt["max_tokens"] == 1
    tap.begin()
    for i in range(0, len(second), 5):
        kept += events(tap.feed(second[i:i + 5], 0.0))
    got = assemble(kept)
    assert got == dict(assemble(STREAM), choices=[dict(
        assemble(STREAM)["choices"][0], token_ids=[4, 5, 6] if client_ids else None,
        prompt_token_ids=[1, 2, 3] if client_ids else None)])
