"""``pushkv proxy``: the command line of the proxy (:mod:`.server`): flags, settings, start-up."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import urllib.parse
from typing import Any, NoReturn

from aiohttp import web

from pushkv import timeline

from .failover import POLICIES
from .pool import HealthSettings
from .server import KEY_ENV, ProxySettings, PushProxy, logger
from .settings import BINDS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``pushkv proxy`` to the ``pushkv`` command line."""
    d, h = ProxySettings(), HealthSettings()
    parser_class = subparsers._parser_class
    subparsers._parser_class = _Parser  # this subcommand's parser only
    try:
        p = subparsers.add_parser(
            "proxy", help="OpenAI-compatible push-mode router for vLLM prefill/decode "
            "instances",
            description="Route each request to a prefill and a decode vLLM instance running "
            "PushKVConnector, sending both legs at once with a shared transfer id; check "
            "instances' health and fail over.",
            formatter_class=_Help,
        )
    finally:
        subparsers._parser_class = parser_class
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   type=_url, help="base URL of a prefill (kv_producer) instance; repeatable")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   type=_url, help="base URL of a decode (kv_consumer) instance; repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--request-timeout", "--timeout", dest="timeout", type=_positive,
                   default=d.request_timeout_s, metavar="SECONDS",
                   help="longest a client waits for its answer or a clear error")
    p.add_argument("--connect-timeout", type=_positive, default=d.connect_timeout_s,
                   metavar="SECONDS", help="opening a connection to an instance")
    p.add_argument("--retries", type=_count, default=d.retries, metavar="N",
                   help="times a request is sent again, as a new transfer, after a leg no "
                   "engine accepted (refused, timed out, its instance left rotation); a "
                   "request an engine failed on is never sent again")
    p.add_argument("--failover", choices=POLICIES, default=d.failover,
                   help="what a leg failing before the answer began leads to: retry (a new "
                   "transfer; prefill computes the prompt again) or retarget (the same decode "
                   "leg, at the next turn, to another decode instance: the prefill instance "
                   "writes the KV it holds there; protocol rule 12)")
    p.add_argument("--bind", choices=BINDS, default=d.bind,
                   help="when a request's decode instance is chosen: arrival (both legs sent "
                   "at once; the decode instance registers while the prompt is computed) or "
                   "late (the decode leg is sent once the prefill leg answered, to the decode "
                   "instance with the least outstanding work then; the producer holds the KV "
                   "and pushes it when the registration comes)")
    p.add_argument("--resumes", type=_count, default=d.resumes, metavar="N",
                   help="times a completion whose decode instance died is resumed on another "
                   "(the prompt plus the tokens generated as the new prompt); non-streamed "
                   "completions are then asked of the decode instance as streams and "
                   "answered as one body; 0: never, a stream ends with an error event and "
                   "non-streamed requests pass through as they are")
    p.add_argument("--health-interval", type=_positive, default=h.interval_s,
                   metavar="SECONDS", help="between health probes of an instance in "
                   "rotation; also the first back-off of one out of rotation")
    p.add_argument("--health-timeout", type=_positive, default=h.timeout_s, metavar="SECONDS",
                   help="a health probe not answered within this has failed")
    p.add_argument("--unhealthy-after", type=_at_least_one, default=h.unhealthy_after,
                   metavar="N", help="failed probes in a row that take an instance out of "
                   "rotation")
    p.add_argument("--backoff-max", type=_positive, default=h.backoff_max_s, metavar="SECONDS",
                   help="longest wait between probes of an instance out of rotation")
    p.add_argument("--probe-generate", type=_not_negative, default=h.generate_timeout_s,
                   metavar="SECONDS", help="also probe with a one-token completion that must "
                   "answer within this (0: /health only); catches an engine loop that is stuck "
                   "while its HTTP server still answers")
    p.add_argument("--max-body-bytes", type=_at_least_one, default=d.max_body_bytes,
                   metavar="BYTES", help="larger request bodies are refused with 413")
    p.add_argument("--max-tokens-limit", type=_count, default=d.max_tokens_limit, metavar="N",
                   help="refuse max_tokens above this (0: only the model's length bounds it)")
    p.add_argument("--key-file", default="", metavar="PATH",
                   help="file holding the shared key (the connectors' key_file) that signs "
                   f"every kv_transfer_params sent; empty: ${KEY_ENV} if set, else no key")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="the proxy's event loop: uvloop's, which relays a token stream with "
                   "less CPU per piece, or asyncio's; auto: uvloop's when it is installed "
                   "(vLLM installs it)")
    p.add_argument("--log-level", default="INFO", type=_log_level,
                   help="logging level: DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--timeline-dir", default="", metavar="DIR",
                   help="record each request's timeline (pushkv.timeline) into this directory "
                   "(empty: off)")
    p.set_defaults(func=_main)


class _Parser(argparse.ArgumentParser):
    """A bad or unknown flag ends ``pushkv proxy`` with one line on stderr and exit
    status 2, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        _refuse(self.prog, message)

    def parse_known_args(  # type: ignore[override]  # the overloads, collapsed
            self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default; required flags and flags without
    one say nothing of it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, argparse.SUPPRESS) or \
                action.option_strings == ["-h", "--help"]:
            return action.help
        help = action.help or ""
        if action.default == "":
            return help + " (default: empty)"
        return super()._get_help_string(action)


def _refuse(prog: str, message: str) -> NoReturn:
    """End ``pushkv proxy`` at start: one line on stderr, exit status 2."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(2)


def _url(text: str) -> str:
    """An instance's base URL: http(s)://host[:port][/path], without query or fragment."""
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port  # ValueError when it is not a number in range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or \
            parts.fragment or port == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a base URL like http://10.0.0.1:8100")
    return text.rstrip("/")


def _number(kind: type[float] | type[int], text: str, low: float, what: str,
            open_low: bool = False) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value) or value < low or (open_low and value == low):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _positive(text: str) -> float:
    return _number(float, text, 0, "a number of seconds above 0", open_low=True)


def _not_negative(text: str) -> float:
    return _number(float, text, 0, "a number of seconds, 0 or more")


def _count(text: str) -> int:
    return int(_number(int, text, 0, "a whole number, 0 or more"))


def _at_least_one(text: str) -> int:
    return int(_number(int, text, 1, "a whole number, 1 or more"))


def _port(text: str) -> int:
    value = int(_number(int, text, 1, "a port (1 to 65535)"))
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return value


def _log_level(text: str) -> str:
    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"{text!r} is not a logging level (DEBUG, INFO, "
                                         "WARNING, ERROR)")
    return text.upper()


#: The event loops ``pushkv proxy --event-loop`` accepts.
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


class EventLoopError(RuntimeError):
    """The event loop asked for cannot be had here."""


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A fresh event loop of ``kind`` (one of :data:`EVENT_LOOPS`) for the proxy."""
    if kind not in EVENT_LOOPS:
        raise EventLoopError(f"unknown event loop {kind!r}: one of {', '.join(EVENT_LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise EventLoopError("--event-loop uvloop: uvloop is not installed "
                                     "(pip install uvloop, or --event-loop asyncio)") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """The settings the flags give; ValueError (ConfigError) naming what is wrong."""
    from pushkv.transports.nixl.sidechannel.auth import load_key

    for role in ("prefill", "decode"):
        seen = set()
        for url in getattr(args, role):
            if url in seen:
                raise ValueError(f"--{role} {url} is given twice")
            seen.add(url)
    both = set(args.prefill) & set(args.decode)
    if both:
        raise ValueError(f"{sorted(both)[0]} is given as both --prefill and --decode: an "
                         "instance has one role")
    try:
        key = load_key(key_file=args.key_file or "", key_env=KEY_ENV)
    except ValueError as exc:
        raise ValueError(f"--key-file: {exc}") from None
    return ProxySettings(
        request_timeout_s=args.timeout, connect_timeout_s=args.connect_timeout,
        retries=args.retries, failover=args.failover, resumes=args.resumes, bind=args.bind,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit, key=key,
        health=HealthSettings(interval_s=args.health_interval, timeout_s=args.health_timeout,
                              unhealthy_after=args.unhealthy_after,
                              backoff_max_s=args.backoff_max,
                              generate_timeout_s=args.probe_generate))


def _main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        loop = new_event_loop(args.event_loop)
    except (ValueError, EventLoopError) as exc:  # ConfigError is a ValueError
        _refuse("pushkv proxy", str(exc))
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    timeline.configure(args.timeline_dir, "proxy")
    proxy = PushProxy(args.prefill, args.decode, settings=settings)
    logger.info("push proxy on %s:%d (%s loop): prefill %s, decode %s, %s", args.host,
                args.port, type(loop).__module__.split(".")[0], args.prefill, args.decode,
                "kv_transfer_params signed" if settings.key else "no shared key")
    web.run_app(proxy.app(), host=args.host, port=args.port, handler_cancellation=True,
                print=None, access_log=None, loop=loop)
    return 0
