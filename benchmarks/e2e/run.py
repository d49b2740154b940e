"""Drive bench_e2e.sh: deployments phase by phase (the plain server kept up, each
connector's pair in turn), modes alternating, latency and outputs checked against
the plain server in the same round.

In each phase, for each iteration, every mode (rows of :data:`modes.MODES`, order rotated each
iteration) serves the same fresh prompts twice: **sequentially** (one request
at a time) and **concurrently** (all at once). Every request is streamed; the
client records its latency, TTFT, TPOT and output tokens, which must equal the
plain server's. Then, optionally (``--serve-qps``), ``vllm bench serve`` runs
against each router mode and the plain server.

Output (``--out``): ``latency.json`` (every request), ``timeline/<mode>/``
(pushkv.timeline marks of routers and clients; ``timeline/<deployment>/``: the
servers'), ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json`` of ``vllm bench serve``,
``logs/``. The last line printed is one JSON object (see :func:`verdict`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pushkv.fit.e2e.modes import DEFAULT_MODES, MODES, SPIN_S  # noqa: E402
from pushkv.fit.e2e.overheads import latency_table, pooled_verdict, timeline_report  # noqa: E402
from pushkv.fit.e2e.phases import run  # noqa: E402
from pushkv.fit.e2e.pull_timeline import pull_report  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma separated, from: {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=3, help="alternating rounds of every mode")
    p.add_argument("--seq-requests", type=int, default=8)
    p.add_argument("--conc-requests", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=100,
                   help="sleep of every NIXL progress thread between polls, all modes alike")
    p.add_argument("--plain-cores", default="0,1",
                   help="the plain baseline: one plain server per core listed, requests "
                   "spread over them in turn (default: one on each core a pair uses, so "
                   "both run on the same two cores; '0': one server, as before)")
    p.add_argument("--spin-s", default=SPIN_S,
                   help="cap how long every vLLM server's processes busy-loop on their "
                   "shared-memory queues after a message (vLLM: 1 s) before sleeping "
                   "(default 2 ms: on 2 cores, a second of spinning by every server that "
                   "served lately takes the CPU from the one serving now); empty: vLLM's")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="sequential load: each mode serves its whole batch in turn (default: "
                   "request by request, every mode serving prompt i before prompt i+1)")
    p.add_argument("--cycles", type=int, default=1,
                   help="run the phases this many times, every other time in reverse order "
                   "(each a fresh start of its servers), so drift reaches every phase alike")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-qps", default="",
                   help="also run `vllm bench serve` at these rates (comma separated) "
                   "against the router modes and plain; empty: skip")
    p.add_argument("--serve-prompts", type=int, default=16)
    p.add_argument("--phases", default="each",
                   help="each (default): the plain server plus one connector's servers at a "
                   "time (modes alternate within a phase), so no connector is measured "
                   "beside another one's idle cost (an idle NixlPushConnector pair slowed a "
                   "plain server next to it by 40-100%% here); auto: the plain server with "
                   "pushkv's and vLLM push's pairs at once, then with each other connector's; "
                   "all: every deployment at once; turns: every deployment up at once, "
                   "but each round's requests served deployment by deployment (order "
                   "rotated per round), plain in each pair's turn, every request with "
                   "only its own deployment running and the others stopped (SIGSTOP: no "
                   "CPU), so the connectors are measured seconds apart and no idle "
                   "neighbour slows a mode or plain (about 18 GiB for plain, pushkv and "
                   "vLLM push); or "
                   "groups of deployments, e.g. 'pushkv+nixl-pull,nixl-push' (the plain "
                   "server is in every group): modes of one group alternate round by round")
    p.add_argument("--verdict-of", type=Path, nargs="+", metavar="DIR",
                   help="run nothing: the JSON verdict of the latency.json of these earlier "
                   "runs' --out directories, their rounds pooled")
    args = p.parse_args()
    if args.verdict_of:
        print(json.dumps(pooled_verdict(args.verdict_of)))
        return 0
    out: Path = args.out
    summary, measured, ok = run(args)
    print()
    print(latency_table(summary, measured))
    print()
    print(timeline_report(out, measured))
    print()
    routed = [k for k in ("pushkv", "nixl-pull")
              if any(MODES[n].deployment == k and MODES[n].name.startswith("router-")
                     for n in measured)]
    if routed:  # a pull behind vllm-router, hop by hop (pushkv.fit.e2e.pull_timeline)
        text, numbers = pull_report(out, routed)
        (out / "pull_timeline.json").write_text(json.dumps(numbers, indent=1))
        print(text)
        print()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
