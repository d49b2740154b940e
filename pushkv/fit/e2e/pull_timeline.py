"""The timeline of a pull behind a sequential router, hop by hop.

Behind ``vllm-router --vllm-pd-disaggregation`` the decode leg leaves only once the
prefill leg answered; the decode side then reads the KV. :data:`PULL_HOPS` names
the marks (:mod:`pushkv.timeline`) such a request meets, in order, from the
prefill leg's arrival to the decode scheduler admitting the request's first decode
step. pushkv's connector records every one; vLLM's ``NixlConnector`` (through the
benchmark's instrumentation) records the marks of :data:`SHARED_HOPS`, so the two
compare on those. Where the prompt's KV is complete differs: pushkv marks
``prefill_finished`` as the worker saves it and ``answered`` once the answer, with
its seal, goes back to vLLM; vLLM's connector has one mark there, its scheduler's
(``prefill_finished``, the answer built), comparable with pushkv's ``answered``.

:func:`hop_segments` turns a request's marks into the consecutive segments of
:data:`PULL_HOPS`; :func:`pull_report` gives each segment's median and p90 per
deployment of a ``bench_e2e`` run, the table printed after the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from pushkv import timeline

#: (mark, what happened), in the order a pull behind a sequential router meets them.
PULL_HOPS: tuple[tuple[str, str], ...] = (
    ("prefill_arrived", "prefill API server: the router's prefill leg parsed"),
    ("prefill_seen", "prefill scheduler: the request considered for a step"),
    ("prefill_finished", "prefill: the prompt's KV complete (pushkv: the worker saved it)"),
    ("answered", "prefill scheduler: the answer (sealed) handed to vLLM to send"),
    ("decode_arrived", "decode API server: the router's decode leg parsed"),
    ("decode_seen", "decode scheduler: the request considered for a step"),
    ("registration_shipped", "decode scheduler: the pull order in the step's metadata"),
    ("registration_handed", "decode worker: the order handed to the transport"),
    ("read_posted", "decode I/O thread: the read planned, handed to the reader"),
    ("reader_took", "reader thread: the job taken off its queue"),
    ("reader_posted", "reader thread: descriptors built, the NIXL READ posted"),
    ("reader_done", "reader thread: the READ seen complete"),
    ("outcome", "decode I/O thread: the completion applied (TransferReady, ReadDone sent)"),
    ("ready", "decode worker: TransferReady taken by the engine's step"),
    ("ready_scheduled", "decode scheduler: vLLM learnt the KV landed"),
    ("decode_scheduled", "decode scheduler: the request admitted for its first step"),
)

#: The marks vLLM's NixlConnector records too: the segments both connectors have.
SHARED_HOPS = ("prefill_arrived", "prefill_seen", "prefill_finished", "decode_arrived",
               "decode_seen", "ready_scheduled", "decode_scheduled")

#: Where the prefill's answer leaves: pushkv's ``answered``; vLLM's connector has only
#: its scheduler's ``prefill_finished`` there (the answer built).
ANSWER_OUT = ("answered", "prefill_finished")

#: Spans over several hops, (name, from, to); ``from`` may name marks in order of
#: preference, the first one a request has counts.
SPANS: tuple[tuple[str, str | tuple[str, ...], str], ...] = (
    ("answer out -> decode arrives (router hop)", ANSWER_OUT, "decode_arrived"),
    ("decode sees -> scheduler knows", "decode_seen", "ready_scheduled"),
    ("decode arrives -> decode step", "decode_arrived", "decode_scheduled"),
    ("prefill finished -> decode step", "prefill_finished", "decode_scheduled"),
    ("prefill arrives -> decode step", "prefill_arrived", "decode_scheduled"),
)

NAMES = tuple(m for m, _ in PULL_HOPS)


def hop_segments(marks: Mapping[str, float], hops: Iterable[str] = NAMES
                 ) -> dict[str, float]:
    """One request's marks (:func:`pushkv.timeline.by_request`) as segments in ms:
    each hop of ``hops`` the request has to the next one it has, then :data:`SPANS`."""
    have = [h for h in hops if h in marks]
    out = {f"{a} -> {b}": (marks[b] - marks[a]) * 1e3 for a, b in pairwise(have)}
    for name, starts, b in SPANS:
        a = next((m for m in ((starts,) if isinstance(starts, str) else starts)
                  if m in marks), None)
        if a is not None and b in marks:
            out[name] = (marks[b] - marks[a]) * 1e3
    return out


def out_of_order(marks: Mapping[str, float], hops: Iterable[str] = NAMES) -> list[str]:
    """The hops of ``hops`` missing from one request's marks, or recorded before the
    hop ahead of them; empty when the request met every hop in order."""
    hops = tuple(hops)
    bad = [f"missing {h}" for h in hops if h not in marks]
    have = [h for h in hops if h in marks]
    bad += [f"{b} before {a}" for a, b in pairwise(have) if marks[b] < marks[a]]
    return bad


#: Marks only a push records (a registration sent, a write posted).
PUSH_MARKS = ("registration_sent", "write_posted")


def pulls(directory: str | Path) -> dict[str, dict[str, float]]:
    """The requests of a timeline directory that were pulled (a ``prefill_finished`` and
    a ``decode_scheduled``, no mark of a push), by transfer (or request) id."""
    reqs = timeline.by_request(timeline.read(directory))
    return {k: v for k, v in reqs.items()
            if "prefill_finished" in v and "decode_scheduled" in v
            and not any(m in v for m in PUSH_MARKS)}


def stats(requests: Mapping[str, Mapping[str, float]], hops: Iterable[str] = NAMES
          ) -> dict[str, dict[str, float]]:
    """Median, p90 and count of every segment over ``requests``."""
    per: dict[str, list[float]] = {}
    for marks in requests.values():
        for k, v in hop_segments(marks, hops).items():
            per.setdefault(k, []).append(v)
    return {k: {"median": timeline.percentile(v, 0.5), "p90": timeline.percentile(v, 0.9),
                "n": len(v)} for k, v in per.items()}


#: A pull counts as served in a batch when its span (``prefill_arrived`` to
#: ``decode_scheduled``) overlaps the spans of at least this many other pulls: in a
#: bench_e2e round, the concurrent requests; the sequential ones overlap at most the
#: one before or after them.
BATCH_OVERLAP = 2


def in_batch(requests: Mapping[str, Mapping[str, float]], overlap: int = BATCH_OVERLAP
             ) -> dict[str, Mapping[str, float]]:
    """The requests whose span from ``prefill_arrived`` to ``decode_scheduled`` overlaps
    the spans of ``overlap`` or more others (a request without both marks is left out)."""
    spans = {k: (m["prefill_arrived"], m["decode_scheduled"]) for k, m in requests.items()
             if "prefill_arrived" in m and "decode_scheduled" in m}
    return {k: requests[k] for k, (a, b) in spans.items()
            if sum(1 for j, (c, d) in spans.items() if j != k and c < b and d > a) >= overlap}


def pull_report(out: Path, deployments: Iterable[str]) -> tuple[str, dict[str, Any]]:
    """Every pulled request's hops per deployment of a run (``out/timeline/<kind>``):
    all hops for pushkv, :data:`SHARED_HOPS` for vLLM's connectors; then the same for
    the pulls served in a batch only (:func:`in_batch`). The tables and the numbers
    (``{"all": ..., "in_batch": ...}``, each per deployment)."""
    got: dict[str, dict[str, dict[str, dict[str, float]]]] = {"all": {}, "in_batch": {}}
    for kind in deployments:
        hops = NAMES if kind == "pushkv" else SHARED_HOPS
        pulled = pulls(out / "timeline" / kind)
        got["all"][kind] = stats(pulled, hops)
        got["in_batch"][kind] = stats(in_batch(pulled), hops)
    text = (table(got["all"]) + "\n\nPulls served in a batch (overlapping "
            f"{BATCH_OVERLAP} or more others) only:\n\n" + table(got["in_batch"]))
    return text, got


def table(got: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """A markdown table: a row per segment (hops in order, then spans), median / p90
    (ms) and count per deployment."""
    kinds = list(got)
    # every hop pair present, in the order of PULL_HOPS (a request missing a mark has
    # the pair around it), then the spans
    spans = [name for name, _, _ in SPANS]
    hops = {k for g in got.values() for k in g if k not in spans}
    order = {h: i for i, h in enumerate(NAMES)}
    rows = sorted(hops, key=lambda k: tuple(order.get(x, 99) for x in k.split(" -> ")))
    rows += spans
    head = ["segment", *(f"{k} median / p90 (ms), n" for k in kinds)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(rows):
        if not any(name in got[k] for k in kinds):
            continue
        cells = [name]
        for k in kinds:
            s = got[k].get(name)
            cells.append(f"{s['median']:.2f} / {s['p90']:.2f}, {s['n']:.0f}" if s else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pushkv.fit.e2e.pull_timeline OUT``: the hop tables of a recorded
    bench_e2e run (every deployment of ``OUT/timeline`` that pulled behind a router)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out", type=Path, help="a bench_e2e.sh results directory")
    p.add_argument("--deployments", default="pushkv,nixl-pull",
                   help="comma separated, those of OUT/timeline (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the numbers, not the tables")
    args = p.parse_args(argv)
    kinds = [k for k in args.deployments.split(",") if (args.out / "timeline" / k).is_dir()]
    if not kinds:
        p.error(f"no timeline of {args.deployments} under {args.out / 'timeline'}")
    text, numbers = pull_report(args.out, kinds)
    print(json.dumps(numbers) if args.json else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
