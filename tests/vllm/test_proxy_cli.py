"""``pushkv proxy``'s command line: every flag's help shows its default, a bad flag or
URL ends it at start with one line on stderr and exit status 2, and its warnings are
one short line each."""

from __future__ import annotations

import argparse
import logging

import aiohttp
import pytest

from pushkv.cli import build_parser, main
from pushkv.vllm.proxy import cli as proxy_cli
from pushkv.vllm.proxy.server import PushProxy, describe

from .test_proxy import FakeVllm
from .test_proxy_failover import SLOW_PROBES, post, run

GOOD = ["--prefill", "http://10.0.0.1:8100", "--decode", "http://10.0.0.2:8200"]


def proxy_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices["proxy"]


def test_every_flag_help_shows_its_default():
    p = proxy_parser()
    text = " ".join(p.format_help().split())
    shown = 0
    for action in p._actions:
        if not action.option_strings or action.required or action.dest == "help":
            continue
        default = "empty" if action.default == "" else action.default
        assert f"(default: {default})" in text, action.option_strings
        shown += 1
    assert shown >= 15
    assert "(default: None)" not in text  # the required URLs have none


@pytest.mark.parametrize(("argv", "names"), [
    (["--prefill", "notaurl", "--decode", "http://10.0.0.2:8200"], "--prefill: 'notaurl'"),
    (["--prefill", "http://10.0.0.1:8100", "--decode", "ftp://10.0.0.2"], "--decode"),
    (["--prefill", "http://10.0.0.1:99999", "--decode", "http://10.0.0.2"], "--prefill"),
    (["--prefill", "http://10.0.0.1:8100?x=1", "--decode", "http://10.0.0.2"], "--prefill"),
    (["--decode", "http://10.0.0.2:8200"], "--prefill"),
    ([*GOOD, "--port", "70000"], "--port"),
    ([*GOOD, "--port", "eighty"], "--port"),
    ([*GOOD, "--retries", "-1"], "--retries"),
    ([*GOOD, "--request-timeout", "0"], "--request-timeout"),
    ([*GOOD, "--health-interval", "nan"], "--health-interval"),
    ([*GOOD, "--unhealthy-after", "0"], "--unhealthy-after"),
    ([*GOOD, "--probe-generate", "-2"], "--probe-generate"),
    ([*GOOD, "--max-body-bytes", "0"], "--max-body-bytes"),
    ([*GOOD, "--log-level", "LOUD"], "--log-level"),
    ([*GOOD, "--event-loop", "trio"], "--event-loop"),
    ([*GOOD, "--key-file", "/no/such/key"], "--key-file"),
    ([*GOOD, "--no-such-flag"], "--no-such-flag"),
    ([*GOOD, "--decode", "http://10.0.0.2:8200/"], "given twice"),
    ([*GOOD, "--decode", "http://10.0.0.1:8100"], "both --prefill and --decode"),
])
def test_a_bad_flag_is_refused_at_start_with_one_line(argv, names, capsys, monkeypatch):
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the proxy started")

    monkeypatch.setattr(proxy_cli.web, "run_app", started)
    with pytest.raises(SystemExit) as info:
        main(["proxy", *argv])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pushkv proxy: error: "), err
    assert names in lines[0], err


def test_warnings_are_one_line_each_without_nested_reprs(caplog):
    p, d = FakeVllm("prefill"), FakeVllm("decode", fail_legs=9)

    async def scenario(url: str, proxy: PushProxy, s: aiohttp.ClientSession) -> None:
        proxy.prefill[0].url = "http://127.0.0.1:9"  # nothing listens: refused
        await post(s, url)  # refused prefill, then no producer: 503
        status, _ = await post(s, url, {"model": "tiny", "prompt": [1], "max_tokens": 2})
        assert status >= 500

    with caplog.at_level(logging.INFO, logger="pushkv.proxy"):
        run([p], [d], scenario, health=SLOW_PROBES)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("http://127.0.0.1:9" in w and "ClientConnectorError: " in w for w in warnings)
    for w in warnings:
        assert "\n" not in w and "ConnectionKey" not in w and "Error(" not in w, w
        assert len(w) < 700, w


def test_an_exception_is_described_by_its_class_and_short_message():
    assert describe(ValueError("a\n   b")) == "ValueError: a b"
    assert describe(ValueError("x" * 500)) == "ValueError: " + "x" * 200
    assert describe(aiohttp.ServerDisconnectedError()) == \
        "ServerDisconnectedError: Server disconnected"
    assert describe(TimeoutError()) == "TimeoutError"
