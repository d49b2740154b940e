"""Measure what a simulator profile needs on this machine; write it as a TOML profile.

``python -m pushkv.fit.measure --out pushkv/sim/profiles/cpu-tiny.toml`` measures, on
the machine it runs on, the figures of the ``cpu-tiny`` profile -- the tiny random
Llama of :mod:`pushkv.vllm.testing` served by vLLM on CPU, one server per core --
and writes them as a profile :func:`~pushkv.sim.profile.load_profile` reads:

* **Engine steps**, through a real vLLM server (the prefill servers' recipe:
  ``ServerSpec(cpu=0, tokenizer=True, prefix_caching=False)``), from vLLM's own
  per-request metrics (``/metrics``): ``vllm:request_prefill_time_seconds`` of
  one-token requests sent one at a time at several prompt lengths is one prefill
  step; ``vllm:request_decode_time_seconds / (output tokens - 1)`` of ``B``
  requests sent at once is one decode step at batch ``B``. Each is fitted as a
  fixed per-step overhead plus a cost per token the step computes (the
  ``step_token_s`` key): the tiny model's matmuls are microseconds, the step is
  Python. The medians of many requests are fitted, not the means: the machine is
  shared.
* **Request overhead**: a request's client-side latency minus its engine time
  (HTTP, the API server, its hand-off to the engine core), and what one
  aiohttp relay in front adds (the routers are aiohttp relays); half of their
  sum is one router hop.
* **NIXL over UCX**, between two processes on host memory with the progress
  thread throttled as the servers' are (``--delay-us``): the posting thread's
  time (``initialize_xfer`` + ``transfer``) by descriptor count, and the time to
  completion by descriptor count and bytes.
* **Side channel**: a protocol frame (:func:`pushkv.protocol.encode`, msgspec)
  over pyzmq PUSH/PULL on loopback, echoed by another process: the sender's
  time, the receiver's time and the one-way latency.
* **The cores meanwhile**: a :class:`~pushkv.fit.cores.CoreProbe` records the share
  of a core a short burst gets; the profile holds every time scaled to a core of its
  own (``time x share``), so that ``cpu_share`` and ``wake_s`` of a later run start
  from it.
* **On the connector servers** (``--connector-timeline DIR [DIR ...]``, off by
  default): what a plain server cannot show, from the :mod:`pushkv.timeline` marks a
  real pushkv pair recorded (its router's or client's directory first, then the
  servers'; the requests that ran alone, unless ``--all-requests``): each leg's
  API-server time beyond the router hop (``ingest_s``), a token's way back beyond
  one step and the hop (``decode.return_s``),
  the step-boundary hand-offs of a push (``decode.order_handoff_s``,
  ``event_handoff_s``, ``admit_lag_s``) and a write's wait for its notification on
  busy cores (``network.notify_wait_s``) -- see
  :func:`pushkv.fit.measure_connector.connector_keys`. ``--pull-timeline DIR ...``
  (a pull pair's marks) adds the prefill answer's way out (``prefill.return_s``),
  ``--client-hop ROUTER_DIR RESULT`` (a router's marks and that run's ``vllm bench
  serve`` result) the client's way to and from the router (``network.client_hop_s``;
  :func:`~pushkv.fit.measure_connector.extend_router`). With ``--base PROFILE``
  nothing else is measured: the keys are added to that profile.

The parts are timed by :mod:`pushkv.fit.timings`;
:func:`~pushkv.fit.cpu_profile.profile_data` turns what they measured (a
:class:`~pushkv.fit.cpu_profile.Measured`) into the profile's tables and validates
them (:func:`~pushkv.sim.profile.profile_from_dict`); a measurement that is not a
finite, positive time, or a fit with a negative overhead, is refused with
:class:`~pushkv.fit.cpu_profile.MeasurementError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..sim.profile import ProfileError
from .cores import CoreProbe
from .cpu_profile import Measured, MeasurementError, header, profile_data, write_data
from .timings import measure_engine, measure_nixl, measure_side_channel


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"a {os.cpu_count()}-core, {mem:.0f} GiB machine without GPU ({os.uname().nodename})"


def measure(work: Path, *, reps: int, delay_us: int) -> Measured:
    load = os.getloadavg()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lengths, batches, dec_in, out_len = (16, 64, 128, 192, 256, 384), (1, 2, 4, 8), 128, 32
    host = CoreProbe()
    host.__enter__()
    print("side channel ...", flush=True)
    side = measure_side_channel(reps)
    print(f"  {side}", flush=True)
    print("NIXL ...", flush=True)
    nixl = measure_nixl(reps, delay_us)
    print(f"  {nixl}", flush=True)
    host.__exit__()
    host_share = min(host.share(0), host.share(1))
    print("engine (one vLLM server) ...", flush=True)
    eng = measure_engine(work, reps, lengths, batches, dec_in, out_len)
    print(f"  {eng['prefill']} {eng['decode']}, core 0: share {eng['share']:.3f}, wake "
          f"{eng['wake'] * 1e3:.2f} ms", flush=True)
    return Measured(
        machine=machine(), when=when, load=(load[0], load[1], load[2]),
        prefill_lengths=tuple(lengths),
        prefill_step_s=tuple(eng["prefill"][n] for n in lengths),
        decode_batches=tuple(batches), decode_step_s=tuple(eng["decode"][b] for b in batches),
        decode_input_len=dec_in,
        request_overhead_s=statistics.median(eng["overhead"]),
        relay_s=max(1e-6, statistics.median(eng["relay"])),
        post_descriptors=tuple(nixl["post_descriptors"]), post_s=tuple(nixl["post_s"]),
        wire_descriptors=tuple(nixl["wire_descriptors"]),
        wire_bytes=tuple(nixl["wire_bytes"]), wire_s=tuple(nixl["wire_s"]), **side,
        engine_share=eng["share"], host_share=host_share, engine_wake_s=eng["wake"],
        engine_speed=eng["speed"],
        probe_samples=min([eng["probe_samples"], *(len(host.wakes.get(c, ())) for c in (0, 1))]),
        cpu_count=os.cpu_count() or 0,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the TOML profile to write")
    p.add_argument("--work", type=Path, default=Path("/tmp/pushkv-measure"),
                   help="model files and server logs")
    p.add_argument("--reps", type=int, default=20, help="requests per measured point")
    p.add_argument("--delay-us", type=int, default=100,
                   help="NIXL progress-thread sleep between polls (as benchmarks/e2e)")
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    c = p.add_argument_group("on the connector servers (off by default)")
    c.add_argument("--connector-timeline", nargs="+", type=Path, metavar="DIR",
                   help="pushkv.timeline directories of a real pushkv pair at low load, the "
                   "router's or client's first, then the servers': add the connector keys "
                   "(ingest_s, decode.return_s, order_handoff_s, event_handoff_s, "
                   "admit_lag_s, network.notify_wait_s) measured from them")
    c.add_argument("--connector-window", nargs=2, type=float, metavar=("T0", "T1"),
                   help="only the requests whose legs left between T0 and T1 "
                   "(time.monotonic; e.g. one point of bench_sim_vs_real, its cpu_probe.json "
                   "'window')")
    c.add_argument("--all-requests", action="store_true",
                   help="take every request of the timeline, not only those that ran alone "
                   "(nothing else in flight: the low-load sample the keys are defined on)")
    c.add_argument("--connector-steps", nargs=2, type=int, metavar=("IN", "OUT"),
                   help="also replace the engines' step overheads by those the connector "
                   "servers ran (the timeline's requests had IN prompt and OUT output "
                   "tokens); the other keys are then taken against them")
    c.add_argument("--host-spread", type=int, default=0, metavar="N",
                   help="with --connector-timeline: also set host.spread, the "
                   "keyed host times' spread around their medians at N quantiles "
                   "(pushkv.fit.measure_connector.host_spread; 0: none)")
    c.add_argument("--timeline-share", type=float, default=1.0, metavar="F",
                   help="the share of a core the pair's processes got meanwhile (a probe's "
                   "figure): the keys are scaled to a core of one's own by it")
    c.add_argument("--pull-timeline", nargs="+", type=Path, metavar="DIR", default=[],
                   help="a real pull pair's timeline (the router's or client's first): add "
                   "prefill.return_s (pushkv.fit.measure_connector.pull_keys)")
    c.add_argument("--client-hop", nargs=2, type=Path, metavar=("ROUTER_DIR", "RESULT"),
                   help="a router's timeline of one run and that run's vllm bench serve "
                   "result file: add network.client_hop_s (measure_connector.client_hop)")
    c.add_argument("--client-window", nargs=2, type=float, metavar=("T0", "T1"),
                   help="with --client-hop: only the router's requests of that interval "
                   "(the run's; time.monotonic, e.g. bench_sim_vs_real's 'window')")
    c.add_argument("--base", type=Path, metavar="PROFILE",
                   help="with --connector-timeline: measure nothing else, add the keys to "
                   "this profile (e.g. pushkv/sim/profiles/cpu-tiny.toml)")
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error("--reps must be at least 2")
    if args.base and not (args.connector_timeline or args.pull_timeline or args.client_hop):
        p.error("--base needs --connector-timeline, --pull-timeline or --client-hop")
    if args.host_spread and not args.connector_timeline:
        p.error("--host-spread needs --connector-timeline")
    try:
        if args.base:
            import tomllib

            text = args.base.read_text()
            lines = text.splitlines()
            lead = next((i for i, line in enumerate(lines) if not line.startswith("#")),
                        len(lines))
            data, head = tomllib.loads(text), [  # the base's header comment, kept
                line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines[:lead]]
        else:
            m = measure(args.work, reps=args.reps, delay_us=args.delay_us)
            if args.json:
                args.json.write_text(json.dumps(dataclasses.asdict(m), indent=1))
            data, head = profile_data(m), header(m)
        if args.connector_timeline:
            from .measure_connector import extend

            win = args.connector_window
            data, head = extend(data, head, args.connector_timeline,
                                window=(win[0], win[1]) if win else None,
                                alone_only=not args.all_requests, steps=args.connector_steps,
                                share=args.timeline_share, spread=args.host_spread)
        if args.pull_timeline or args.client_hop:
            from .measure_connector import extend_router

            data, head = extend_router(data, head, pull_dirs=args.pull_timeline,
                                       client=args.client_hop, share=args.timeline_share,
                                       client_window=args.client_window)
        prof = write_data(data, head, args.out)
    except (MeasurementError, ProfileError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (profile {prof.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
