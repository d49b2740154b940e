"""When the producer's prompt KV is final: every push's feed (progressive push and
the whole-request push's end alike).

With ``push_granularity`` ``"chunk"`` or ``"layer"``, the scheduler half tells
the workers, with each step's metadata, which prompt tokens of a prefilling
request that step computes and in which blocks they lie
(:class:`~.metadata.RangeOrder`); the workers report them to the transport as
they are saved -- every layer at once after the step (``chunk``), or each layer
as its attention returns (``layer``). ``prefill_finished`` still ends the
stream, so nothing changes for a request whose prompt fits one step except
that its KV leaves while the step's later layers compute.

Where it comes from. vLLM's scheduler output lists, per request, the tokens
scheduled this step (``num_scheduled_tokens``) and the tokens computed before
it (``num_computed_tokens`` of the new or cached request data), and the
request's blocks (``block_ids`` of a new request, ``new_block_ids`` appended --
or replacing them for a resumed one). After the step, tokens
``[computed, computed + scheduled)`` are final in those blocks.

What is reported. Only whole vLLM blocks, plus the prompt's last partial block
in the step that computes the prompt's end: a range is
``[reported, end)`` where ``reported`` is what earlier steps reported and
``end`` is this step's end rounded down to a block (or the prompt's length).
vLLM's CPU cache packs a block's tokens into pages that only move whole, and a
block half computed is never reported; ranges never overlap and every
prompt token is reported exactly once, in order. A local prefix-cache hit is
reported with the first step's range (its KV is final already).

Preemption. vLLM frees a preempted request's blocks at once and recomputes it
later into other blocks, so KV already reported (perhaps written, perhaps with
a write still reading those blocks) no longer describes the request: a
request preempted after its first range is aborted (the protocol fails the
consumer's transfer, whose destination blocks are fenced) and not pushed when
it finishes. One preempted before any range simply starts over.

Finished with the step. A prefill leg asks for one token, so it ends with the
step that completes its prompt. For such a request the prefill is finished as
that step's forward ends (:attr:`~.metadata.PushKVMetadata.send_at_save`), not
one engine step later when vLLM reports it finished: whole-request push
(``push_granularity`` ``"request"``, the default) reports nothing else, its one
range being the whole prompt; chunk and layer close their stream there.

Ended otherwise. A request aborted once its whole prompt was reported has
complete KV, which may already have landed: it is pushed as if it had
finished (its decode side may even have answered first -- ``pushkv proxy``
then cancels the prefill leg, whose answer nobody needs). One aborted before
is aborted, as with whole-request push.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .metadata import Abort, RangeOrder, SendOrder

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass(slots=True)
class _Stream:
    req_id: str
    transfer_id: str
    incarnation: int
    num_prompt: int
    blocks: list[int] = field(default_factory=list)
    reported: int = 0  #: prompt tokens [0, reported) were reported final
    ends: bool = False  #: the request ends with the step that completes its prompt
    ranges: bool = True  #: reported step by step (else only the whole prompt, at its end)


class ProgressiveFeed:
    """The scheduler half's record of prefilling requests whose KV streams out."""

    def __init__(self, block_size: int, *, ranges: bool = True) -> None:
        """``ranges``: report the KV step by step (chunk, layer); False (request):
        only the whole prompt, as the step that completes it ends."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.ranges = ranges
        self._streams: dict[str, _Stream] = {}
        self._cut: set[str] = set()  # preempted after a range: aborted, never pushed

    def track(self, req_id: str, transfer_id: str, incarnation: int, num_prompt: int, *,
              ends: bool = False, whole: bool = False) -> None:
        """A prefill request was admitted (again, after a preemption: no change).
        ``ends``: it ends with the step that completes its prompt (a prefill leg asks
        for one token), so its prefill is finished as that step ends. ``whole``: report
        only the whole prompt, whatever the feed's ``ranges`` (a source published for a
        pull is read whole)."""
        if req_id not in self._streams and req_id not in self._cut:
            self._streams[req_id] = _Stream(req_id, transfer_id, incarnation, num_prompt,
                                            ends=ends, ranges=self.ranges and not whole)

    def step(self, out: SchedulerOutput
             ) -> tuple[list[RangeOrder], list[Abort], list[SendOrder]]:
        """This step's ranges, the aborts of requests preempted mid-stream, and the
        prefills this step finishes (of requests that end with it)."""
        aborts: list[Abort] = []
        for req_id in out.preempted_req_ids or ():
            s = self._streams.get(req_id)
            if s is None:
                continue
            if s.reported:
                del self._streams[req_id]
                self._cut.add(req_id)
                aborts.append(Abort(req_id=req_id, transfer_id=s.transfer_id,
                                    incarnation=s.incarnation))
            else:
                s.blocks = []
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            s = self._streams.get(new.req_id)
            if s is not None:
                s.blocks = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            s = self._streams.get(req_id)
            if s is None:
                continue
            more = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                s.blocks = list(more[0]) if more is not None else []
            elif more is not None:
                s.blocks.extend(more[0])
            computed[req_id] = cached.num_computed_tokens[i]
        ranges: list[RangeOrder] = []
        finishes: list[SendOrder] = []
        bs = self.block_size
        for req_id, before in computed.items():
            s = self._streams[req_id]
            end = min(before + out.num_scheduled_tokens.get(req_id, 0), s.num_prompt)
            if end < s.num_prompt:
                end -= end % bs
            if end <= s.reported or (not s.ranges and end < s.num_prompt):
                continue
            blocks = tuple(s.blocks[:-(-end // bs)])
            if s.ranges:
                ranges.append(RangeOrder(req_id=req_id, transfer_id=s.transfer_id,
                                         block_ids=blocks, start=s.reported, end=end,
                                         incarnation=s.incarnation))
            s.reported = end
            if s.ends and end == s.num_prompt:
                finishes.append(SendOrder(req_id=req_id, transfer_id=s.transfer_id,
                                          block_ids=blocks, num_tokens=end,
                                          incarnation=s.incarnation))
        return ranges, aborts, finishes

    def finished(self, req_id: str) -> int | None:
        """The request ended: the prompt tokens its stream reported (0: not streamed),
        None if it was aborted when preempted mid-stream (push nothing)."""
        s = self._streams.pop(req_id, None)
        if req_id in self._cut:
            self._cut.discard(req_id)
            return None
        return s.reported if s is not None else 0

    def streaming(self) -> dict[str, int]:
        """Requests tracked, with the prompt tokens reported so far."""
        return {k: s.reported for k, s in self._streams.items()}
