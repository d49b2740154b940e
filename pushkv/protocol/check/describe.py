"""How the checker narrates: short forms of messages, items in flight, actions, steps."""

from __future__ import annotations

from typing import Any

from ..events import Action, IssueWrite, SendMessage
from ..messages import Message
from .owed import touched
from .world import DONE, FRAME, HELLO, READ, SCATTER, SWRITE, WRITE, Item


def brief(msg: Message) -> str:
    """A short readable form of a message."""
    name = type(msg).__name__
    f = msg.__struct_fields__
    parts = []
    if "transfer_id" in f:
        inc = getattr(msg, "incarnation", 0)
        parts.append(f"{msg.transfer_id}" + (f"#{inc}" if inc else ""))  # type: ignore[union-attr]
    if "attempt" in f:
        parts.append(f"a{msg.attempt}")  # type: ignore[union-attr]
    if "block_ids" in f:
        parts.append(f"blocks={list(msg.block_ids)}")  # type: ignore[union-attr]
    if "final" in f:
        parts.append("final" if msg.final else "preempt")  # type: ignore[union-attr]
    if "part" in f:  # rule 9: which write of the rank, and the count on its last
        parts.append(f"part {msg.part}" + (f"/{msg.parts}" if msg.parts else ""))  # type: ignore[union-attr]
    elif "parts" in f and msg.parts:  # type: ignore[union-attr]
        parts.append(f"parts={msg.parts}")  # type: ignore[union-attr]
    if "reason" in f:
        parts.append(msg.reason.name)  # type: ignore[union-attr]
    if "transfers" in f:
        parts.append(repr(list(msg.transfers)))  # type: ignore[union-attr]
    return f"{name}({' '.join(parts)})"


class Describe:
    """The narrating part of :class:`~.model.Model`."""

    d_stride: int

    def message(self, frame: bytes) -> Message:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _name(self, i: int) -> str:  # pragma: no cover - provided by Model
        raise NotImplementedError

    def _item(self, item: Item) -> str:
        if item[0] == FRAME:
            return f"{brief(self.message(item[5]))} {item[3]}{item[4]} -> {item[1]}{item[2]}"
        to = "E0" if item[0] in (WRITE, DONE) and item[2] < 0 else f"D{item[2]}"
        if item[0] == WRITE:
            return f"P{item[1]}'s write of t#{item[8]} a{item[3]} to {to}"
        if item[0] == HELLO:
            return f"the handshake of D{item[1]} with P{item[2]}"
        if item[0] == SWRITE:
            return f"P{item[1]}'s packed write of t#{item[8]} a{item[3]} to D{item[2]}"
        if item[0] == SCATTER:
            return f"D{item[1]}'s scatter of P{item[2]}'s a{item[3]} write"
        if item[0] == READ:
            return f"D{item[2]}'s read of t#{item[8]} a{item[3]} from P{item[1]}"
        return f"the completion of P{item[1]}'s write of a{item[3]} to {to}"

    def _action(self, a: Action) -> str:
        if isinstance(a, SendMessage):
            return f"send {brief(a.message)} to {a.peer.engine_id}{a.peer.rank}"
        if isinstance(a, IssueWrite):
            if a.peer.engine_id == "E":  # rule 12's engine (its memory is not modelled)
                return f"IssueWrite(a{a.attempt} to E0)"
            return (f"IssueWrite(a{a.attempt} to D{a.peer.rank} blocks "
                    f"{list(touched(a.plan, self.d_stride, 1))})")
        return repr(a)

    def describe(self, step: tuple[Any, ...]) -> str:
        """One line for a step, before it runs."""
        kind = step[0]
        if kind in ("deliver", "dup", "drop", "land", "wfail", "complete", "hello", "hsfail",
                    "scatter", "sfail", "vanish", "readdone", "readfail"):
            return f"{kind} {self._item(step[1])}"
        if kind in ("piece", "read"):
            return f"piece {step[2]} of {self._item(step[1])}"
        if kind == "tick":
            return f"timer of {self._name(step[1])}"
        if kind == "kill":
            return f"engine {step[1]} dies"
        if kind == "range":
            return f"range {step[2]} of t#{step[1]} final"
        return f"{kind} t#{step[1]}"
