#!/usr/bin/env bash
# End-to-end P/D latency on this machine, every connector on the same footing.
#
# Deployments (prefill on core 0, decode on core 1, tiny model, prefix caching
# off): pushkv (PushKVConnector), vLLM's NixlPushConnector and NixlConnector
# (pull), and plain servers (no disaggregation), kept up while each connector's
# pair comes up in turn (--phases: each, auto, all, turns, groups; turns: every
# deployment up, each request served with all but its own stopped (SIGSTOP),
# pairs taking turns each round).
# Every NIXL progress thread sleeps --delay-us between polls and every
# transport thread stays on its server's core (pushkv/vllm/cpu_tuning fixes vLLM's).
# Modes (pushkv/fit/e2e/modes.py): each connector with both legs sent by the
# benchmark client itself (push-client, vllm-push-client, pull-client) and
# behind its router (push: `pushkv proxy`; vllm-push, pull: vLLM's example
# proxy logic). Modes alternate over --iters rounds; each round serves the same
# fresh prompts sequentially and concurrently, streamed, and checks every
# output against the plain server's. Prints a latency table, the per-request
# timeline report (pushkv.timeline), and last one JSON object:
# overhead_ratio_vs_vllm_push_{seq,conc} (and their 95% intervals over rounds,
# _ci95), proxy_hop_ms, medians per mode; with router-pushkv and router-pull
# (each behind vllm-router) router_pushkv_vs_pull_{seq,conc} with their 95%
# intervals over rounds and router_rounds, and the hops of a pull behind the
# router per deployment (pushkv/fit/e2e/pull_timeline.py, pull_timeline.json):
#   benchmarks/bench_e2e.sh OUT --modes plain,router-pushkv,router-pull,push \
#       --phases turns --iters 20
# benchmarks/e2e/idle_cost.py measures what an idle pair costs a server beside it.
#
#   benchmarks/bench_e2e.sh [RESULTS_DIR] [benchmarks/e2e/run.py flags...]
#   e.g. benchmarks/bench_e2e.sh /tmp/e2e --iters 5 --serve-qps 2,inf
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
if ls "$OUT"/*_qps*_iter*.json >/dev/null 2>&1; then
  "$PY" "$ROOT/benchmarks/e2e/report.py" "$OUT" --stat median > "$OUT/serve.md" || true
fi
cat "$OUT/summary.json" | "$PY" -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))'
exit $rc
