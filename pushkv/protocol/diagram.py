"""Draw the state machines from the transition tables (Mermaid), for the docs.

``python -m pushkv.protocol.diagram > docs/state-machines.md`` regenerates the
page; a test checks the committed page is current, so it cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from .states import (
    CONSUMER_TABLE,
    PRODUCER_TABLE,
    SOURCE_TABLE,
    ZOMBIE_TABLE,
    ConsumerState,
    ProducerState,
    SourceState,
    ZombieState,
)

_INTRO = """\
# pushkv state machines

Generated from the transition tables in `pushkv/protocol/states.py` by
`python -m pushkv.protocol.diagram`; do not edit by hand. Self-loops that
change nothing (including dropping a stale or repeated message) are left out
of the diagrams; the tables list every pair.
"""


Table = Mapping[tuple[Any, Any], tuple[Any, Any]]


def mermaid(table: Table, start: list[Enum]) -> str:
    lines = ["stateDiagram-v2"]
    lines += [f"    [*] --> {s.name}" for s in start]
    for (state, inp), (effect, nxt) in table.items():
        if nxt == state and effect.value in ("none", "drop stale"):
            continue
        label = inp.value if effect.value == "none" else f"{inp.value} / {effect.value}"
        lines.append(f"    {state.name} --> {nxt.name}: {label}")
    return "\n".join(lines)


def markdown_table(table: Table) -> str:
    rows = ["| state | input | effect | next |", "|---|---|---|---|"]
    rows += [
        f"| {s.name} | {i.value} | {e.value} | {n.name} |"
        for (s, i), (e, n) in table.items()
    ]
    return "\n".join(rows)


def page() -> str:
    parts = [
        _INTRO,
        "## Producer leg (one per producer rank and consumer rank)\n",
        "```mermaid\n"
        + mermaid(PRODUCER_TABLE, [ProducerState.EMPTY]) + "\n```\n",
        markdown_table(PRODUCER_TABLE) + "\n",
        "## Source of a transfer (one per producer rank and transfer)\n",
        "```mermaid\n"
        + mermaid(SOURCE_TABLE, [SourceState.PENDING]) + "\n```\n",
        markdown_table(SOURCE_TABLE) + "\n",
        "## Consumer transfer (one per consumer rank)\n",
        "```mermaid\n"
        + mermaid(CONSUMER_TABLE, [ConsumerState.REGISTERED]) + "\n```\n",
        markdown_table(CONSUMER_TABLE) + "\n",
        "## Zombie attempt (an attempt abandoned by a reissue before its fence)\n",
        "```mermaid\n"
        + mermaid(ZOMBIE_TABLE, [ZombieState.FENCING]) + "\n```\n",
        markdown_table(ZOMBIE_TABLE) + "\n",
    ]
    return "\n".join(parts)


if __name__ == "__main__":  # pragma: no cover
    print(page(), end="")
