"""Progressive push: TTFT of chunk-wise and layer-wise push against whole-request push.

(a) Simulator (:mod:`pushkv.sim.progressive`): for each profile -- the
    calibrated p5en one, 100 Gbps TCP, 8x H20 with 4x400 Gbps InfiniBand
    serving a 72B model -- one request on idle engines at 1k, 4k, 8k and 16k
    input: TTFT of each mode, its ratio to whole-request push, and the share
    of push's exposed transfer each mode hides behind prefill (1: at the
    free-transfer floor).
(b) Real vLLM CPU engines: needs the connector's ``push_granularity`` feed;
    ``--real`` runs it when the connector has it, else the table says so and
    the JSON fields are null.

The last line is one JSON object: ``sim_hidden_share_16k`` (layer-wise, the
smallest over the profiles), ``sim_ttft_ratio_layer_16k`` (the largest over
the profiles), ``real_ttft_ratio_layer``, ``real_ttft_ratio_chunk``.

    PYTHONPATH=. python benchmarks/bench_progressive.py [--real]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pushkv.sim.progressive import PROFILES, named_profile, table

LENGTHS = (1024, 4096, 8192, 16384)


def simulate() -> dict[str, list[dict[str, float]]]:
    return {name: table(named_profile(name), LENGTHS) for name in PROFILES}


def print_sim(results: dict[str, list[dict[str, float]]]) -> None:
    print("simulator: TTFT (ms) by push mode, one request on idle engines")
    head = (f"{'profile':<9} {'input':>6} {'push':>8} {'chunk':>8} {'layer':>8} {'free':>8}"
            f" {'chunk/push':>10} {'layer/push':>10} {'hid chunk':>9} {'hid layer':>9}"
            f" {'writes':>6}")
    print(head)
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<9} {r['input_len']:>6} {r['ttft_push_ms']:>8.1f}"
                  f" {r['ttft_chunk_ms']:>8.1f} {r['ttft_layer_ms']:>8.1f}"
                  f" {r['ttft_free_ms']:>8.1f} {r['ratio_chunk']:>10.3f}"
                  f" {r['ratio_layer']:>10.3f} {r['hidden_chunk']:>9.3f}"
                  f" {r['hidden_layer']:>9.3f} {r['writes_layer']:>6.0f}")


def real() -> dict[str, Any]:
    from pushkv.vllm import config

    if "push_granularity" not in getattr(config.PushKVSettings, "__dataclass_fields__", {}):
        return {"skipped": "the connector has no push_granularity setting yet"}
    raise NotImplementedError("real-engine comparison")  # pragma: no cover


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="also run real vLLM CPU engines")
    args = ap.parse_args()
    sim = simulate()
    print_sim(sim)
    at16 = {name: rows[-1] for name, rows in sim.items()}
    out: dict[str, Any] = {
        "sim_hidden_share_16k": round(min(r["hidden_layer"] for r in at16.values()), 4),
        "sim_ttft_ratio_layer_16k": round(max(r["ratio_layer"] for r in at16.values()), 4),
        "sim_hidden_share_16k_by_profile": {n: round(r["hidden_layer"], 4)
                                            for n, r in at16.items()},
        "real_ttft_ratio_layer": None,
        "real_ttft_ratio_chunk": None,
    }
    if args.real:
        got = real()
        print(f"real engines: {got}")
        out.update({k: v for k, v in got.items() if k.startswith("real_")})
    else:
        print("real engines: not run (pass --real)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
