"""``pushkv`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: Subcommands that live with their module: (module, attribute adding parsers).
#: Imported lazily so each works with only its own extra installed.
_PLUGINS = [
    ("pushkv.sim.cli", "register"),
    ("pushkv.sim.planner.cli", "register"),
    ("pushkv.vllm.proxy.cli", "register"),
    ("pushkv.vllm.up", "register"),
]


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return 0 if run() else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pushkv",
        description="Push-based KV-cache transfer for disaggregated LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="walk a few pushes through the in-memory transport and show each side",
        description="Run producer and consumer endpoints over the in-memory transport in "
        "every arrival order, with a preemption/reissue and a cancel, and print the timeline.",
    )
    demo.set_defaults(func=_demo)
    for module, attr in _PLUGINS:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if exc.name is not None and exc.name.startswith("pushkv"):
                continue  # that part is not in this build
            name = module.split(".")[1]
            stub = sub.add_parser(name, help=f"(needs the '{name}' extra: {exc.name} missing)")
            stub.set_defaults(func=lambda a, e=exc, n=name: _missing(n, e))
            continue
        getattr(mod, attr)(sub)
    return parser


def _missing(extra: str, exc: ImportError) -> int:
    print(f"pushkv: this command needs `pip install pushkv[{extra}]` ({exc})", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
