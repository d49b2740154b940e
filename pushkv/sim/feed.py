"""Progressive push's feed: what a prefill step makes final, and when, as the engine
model computes it (the vLLM connector's feed: :mod:`pushkv.vllm.progressive`).

:func:`step_end` is where a prompt's reported tokens end after a step;
:class:`Layers` cuts a step's compute at each layer's end for layer-wise push.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from .host.model import HostModel, Side


def step_end(computed: int, scheduled: int, prompt: int, block_size: int) -> int:
    """The end of the tokens final after a step that computes ``scheduled`` tokens of a
    ``prompt``-token prompt from token ``computed`` on: the step's end rounded down to a
    block, or the prompt's end (a block half computed is never reported)."""
    end = min(computed + scheduled, prompt)
    return end if end == prompt else end - end % block_size


@dataclass(frozen=True, slots=True)
class Layers:
    """A prefill step's compute cut layer by layer: ``head_s`` (the step's fixed
    overhead) from its start, then ``count`` layers of ``per_layer_s`` each; ``done(l)``
    is called as layer ``l`` ends."""

    head_s: float
    per_layer_s: float
    count: int
    done: Callable[[int], None]

    def run(self, host: HostModel, elapsed: float, side: Side) -> Generator[Any, Any, None]:
        """The step's work after its first ``elapsed`` seconds, on ``host`` (``side``: the
        engine's, prefill's)."""
        for i, seg in enumerate((self.head_s, *(self.per_layer_s,) * self.count)):
            done = min(elapsed, seg)
            elapsed -= done
            if seg > done:
                yield host.work(seg - done, side)
            if i:
                self.done(i - 1)
