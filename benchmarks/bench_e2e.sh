#!/usr/bin/env bash
# End-to-end P/D benchmark on this machine: for each mode, start a prefill
# server (core 0) and a decode server (core 1) with the tiny model, put the
# mode's router in front, and run `vllm bench serve` (random dataset) at a few
# request rates. Modes: push (pushkv: PushKVConnector + pushkv proxy), pull
# (vLLM's NixlConnector), vllm-push (vLLM's NixlPushConnector), plain (one
# server, no disaggregation). Writes {mode}_qps{q}_in{i}_out{o}_iter{n}.json
# (read by `pushkv plot --results-dir`), status.json, and a TTFT/TPOT summary;
# the last line is one JSON object of the medians and their ratios to push.
#
#   benchmarks/bench_e2e.sh [RESULTS_DIR] [benchmarks/e2e/run.py flags...]
#   e.g. benchmarks/bench_e2e.sh /tmp/e2e --modes push,pull --qps 2,inf --input-len 256
#
# Env: PYTHON (default: python3 on PATH). Every server is stopped at the end,
# also on failure or Ctrl-C.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${1:-$ROOT/benchmarks/results/e2e}
[ $# -gt 0 ] && shift
export HF_HUB_OFFLINE=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
rc=0
"$PY" "$ROOT/benchmarks/e2e/run.py" --out "$OUT" "$@" || rc=$?
"$PY" "$ROOT/benchmarks/e2e/report.py" "$OUT" --stat mean | tee "$OUT/summary.md"
"$PY" "$ROOT/benchmarks/e2e/report.py" "$OUT" --stat median | tee -a "$OUT/summary.md"
"$PY" "$ROOT/benchmarks/e2e/report.py" "$OUT" --stat median --json
exit $rc
