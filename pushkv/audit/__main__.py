"""``python -m pushkv.audit DIR [--json] [--fence-grace S]``: see :mod:`pushkv.audit`."""

from __future__ import annotations

import argparse
import json
import sys

from . import __doc__ as DOC
from .report import audit
from .rules import DEFAULT_GRACE_S
from .steps import AuditInputError

#: Exit statuses.
CLEAN, VIOLATIONS, UNREADABLE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pushkv.audit", description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="the run's timeline directory (timeline_dir)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object (clean, counts, violations) instead of lines")
    p.add_argument("--fence-grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
                   help="fence grace (s) of consumers whose steps do not record theirs "
                        f"(default {DEFAULT_GRACE_S:g}, ConsumerConfig.fence_grace_s)")
    args = p.parse_args(argv)
    if not args.fence_grace >= 0:
        p.error(f"--fence-grace must be >= 0, got {args.fence_grace}")
    try:
        report = audit(args.dir, args.fence_grace)
    except AuditInputError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"pushkv.audit: cannot audit: {exc}", file=sys.stderr)
        return UNREADABLE
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print("\n".join(report.lines()))
    return CLEAN if report.clean else VIOLATIONS


if __name__ == "__main__":
    raise SystemExit(main())
