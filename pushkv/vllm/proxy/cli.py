"""``pushkv proxy``: the command line of the proxy (:mod:`.server`): flags, settings, start-up."""

from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

from pushkv import timeline

from .pool import HealthSettings
from .server import KEY_ENV, ProxySettings, PushProxy, logger


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``pushkv proxy`` to the ``pushkv`` command line."""
    d, h = ProxySettings(), HealthSettings()
    p = subparsers.add_parser(
        "proxy", help="OpenAI-compatible push-mode router for vLLM prefill/decode instances",
        description="Route each request to a prefill and a decode vLLM instance running "
        "PushKVConnector, sending both legs at once with a shared transfer id; check "
        "instances' health and fail over.",
    )
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="base URL of a prefill (kv_producer) instance; repeatable")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="base URL of a decode (kv_consumer) instance; repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--request-timeout", "--timeout", dest="timeout", type=float,
                   default=d.request_timeout_s,
                   help="longest a client waits for its answer or a clear error (s)")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s,
                   help="opening a connection to an instance (s)")
    p.add_argument("--retries", type=int, default=d.retries,
                   help="times a request is sent again, as a new transfer, after a leg "
                   "failed before any output")
    p.add_argument("--health-interval", type=float, default=h.interval_s,
                   help="seconds between health probes of an instance in rotation; also "
                   "the first back-off of one out of rotation")
    p.add_argument("--health-timeout", type=float, default=h.timeout_s,
                   help="a health probe not answered within this has failed (s)")
    p.add_argument("--unhealthy-after", type=int, default=h.unhealthy_after,
                   help="failed probes in a row that take an instance out of rotation")
    p.add_argument("--backoff-max", type=float, default=h.backoff_max_s,
                   help="longest wait between probes of an instance out of rotation (s)")
    p.add_argument("--probe-generate", type=float, default=h.generate_timeout_s,
                   metavar="SECONDS", help="also probe with a one-token completion that must "
                   "answer within this (0: /health only); catches an engine loop that is stuck "
                   "while its HTTP server still answers")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="larger request bodies are refused with 413")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                   help="refuse max_tokens above this (0: only the model's length bounds it)")
    p.add_argument("--key-file", default=None,
                   help="file holding the shared key (the connectors' key_file) that signs "
                   f"every kv_transfer_params sent; default: ${KEY_ENV}, else none")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="the proxy's event loop: uvloop's, which relays a token stream with "
                   "less CPU per piece, or asyncio's; auto: uvloop's when it is installed "
                   "(vLLM installs it)")
    p.add_argument("--log-level", default="INFO", help="logging level")
    p.add_argument("--timeline-dir", default="",
                   help="record each request's timeline (pushkv.timeline) into this directory")
    p.set_defaults(func=_main)


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
    from pushkv.transports.nixl.sidechannel.auth import load_key

    key = load_key(key_file=args.key_file or "", key_env=KEY_ENV)
    return ProxySettings(
        request_timeout_s=args.timeout, connect_timeout_s=args.connect_timeout,
        retries=args.retries, max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit, key=key,
        health=HealthSettings(interval_s=args.health_interval, timeout_s=args.health_timeout,
                              unhealthy_after=args.unhealthy_after,
                              backoff_max_s=args.backoff_max,
                              generate_timeout_s=args.probe_generate))


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    try:
        loop = new_event_loop(args.event_loop)
    except EventLoopError as exc:
        raise SystemExit(f"pushkv proxy: {exc}") from None
    timeline.configure(args.timeline_dir, "proxy")
    proxy = PushProxy(args.prefill, args.decode, settings=settings)
    logger.info("push proxy on %s:%d (%s loop): prefill %s, decode %s, %s", args.host,
                args.port, type(loop).__module__.split(".")[0], args.prefill, args.decode,
                "kv_transfer_params signed" if settings.key else "no shared key")
    web.run_app(proxy.app(), host=args.host, port=args.port, handler_cancellation=True,
                print=None, access_log=None, loop=loop)
    return 0
