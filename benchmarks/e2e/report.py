"""TTFT and TPOT of every mode side by side, as ratios to pushkv push.

Reads the ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json`` files of bench_e2e.sh
(``vllm bench serve`` results), averages iterations and prints one markdown
table per metric: a row per (input length, rate), a column per mode, and the
ratio of each mode to ``push`` (above 1: slower than push).

Usage: python benchmarks/e2e/report.py RESULTS_DIR [--stat mean|median|p99] [--json]

With ``--json`` it prints one JSON object instead: per metric, per
``in{input}_qps{rate}`` point, each mode's value in ms and its ratio to push.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"^(?P<mode>[A-Za-z0-9-]+)_qps(?P<qps>inf|[\d.]+)_in(?P<input>\d+)"
                  r"_out(?P<output>\d+)_iter(?P<iter>\d+)\.json$")
ORDER = ("push", "vllm-push", "pull", "plain")


def load(results: Path, key: str) -> dict[tuple[int, str], dict[str, float]]:
    values: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(results.iterdir()):
        m = NAME.match(path.name)
        if m is None:
            continue
        data = json.loads(path.read_text())
        if data.get("failed") or key not in data:
            continue
        values[int(m["input"]), m["qps"]][m["mode"]].append(float(data[key]))
    return {k: {mode: sum(v) / len(v) for mode, v in modes.items()}
            for k, modes in values.items()}


def rate_key(qps: str) -> float:
    return float("inf") if qps == "inf" else float(qps)


def table(title: str, rows: dict[tuple[int, str], dict[str, float]]) -> str:
    modes = [m for m in ORDER if any(m in r for r in rows.values())]
    modes += sorted({m for r in rows.values() for m in r} - set(modes))
    others = [m for m in modes if m != "push"]
    head = ["input", "qps", *(f"{m} (ms)" for m in modes), *(f"{m}/push" for m in others)]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for (input_len, qps) in sorted(rows, key=lambda k: (k[0], rate_key(k[1]))):
        r = rows[input_len, qps]
        cells = [str(input_len), qps]
        cells += [f"{r[m]:.1f}" if m in r else "-" for m in modes]
        for m in others:
            ok = m in r and "push" in r and r["push"] > 0
            cells.append(f"{r[m] / r['push']:.2f}" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--stat", default="mean", choices=("mean", "median", "p99"))
    p.add_argument("--json", action="store_true", help="one JSON line instead of tables")
    args = p.parse_args()
    if args.json:
        print(json.dumps({
            f"{args.stat}_{metric}_ms": {
                f"in{i}_qps{q}": {m: round(v, 3) for m, v in r.items()}
                | {f"{m}_vs_push": round(v / r["push"], 3) for m, v in r.items()
                   if m != "push" and r.get("push")}
                for (i, q), r in sorted(load(args.results, f"{args.stat}_{metric}_ms").items())
            }
            for metric in ("ttft", "tpot")
        }))
        return
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT")):
        rows = load(args.results, f"{args.stat}_{metric}_ms")
        print(table(f"{args.stat} {title}", rows) if rows else f"no {title} results")
        print()


if __name__ == "__main__":
    main()
