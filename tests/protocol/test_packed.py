"""Rule 10, endpoint by endpoint: packed writes, the consumer's scatter, and staging
lent and fenced like destination blocks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushkv.protocol import (
    Cancel,
    CancelAck,
    ConsumerConfig,
    ConsumerState,
    FailReason,
    IssueWrite,
    LocalProtocolError,
    Notify,
    PackingConfig,
    Peer,
    ProducerConfig,
    Register,
    Rejected,
    ReleaseDestination,
    ReleaseStaging,
    Scatter,
    TransferCancelled,
    TransferFailed,
    TransferReady,
    decode,
    encode,
)
from pushkv.protocol.lending import StagingLedger, share

from .helpers import Pair, msgs, of

CS = ConsumerState
ALWAYS = PackingConfig(mode="always", staging_bytes=1 << 20, chunk_bytes=4096)
LAYOUT = {"num_blocks": 32, "num_kv_heads": 2, "head_dim": 4, "block_size": 4}
P0 = Peer("P", 0)


def _pair(*, producer=None, consumer=None, pk=ALWAYS, ck=ALWAYS, window_s=10.0):
    return Pair(producer=LAYOUT | (producer or {}), consumer=LAYOUT | (consumer or {}),
                pcfg=ProducerConfig(packing=pk),
                ccfg=ConsumerConfig(packing=ck, window_s=window_s, fence_grace_s=5.0))


def _staged(pair, dst=(3, 9, 1), src=(7, 2, 5), n=10):
    """Register, finish the prefill, land the packed write: the consumer scatters."""
    c, p = pair.c[0], pair.p[0]
    pair.to_producers(c.register("t", "P", list(dst), n, pair.now))
    (w,) = of(p.prefill_finished("t", list(src), n, pair.now), IssueWrite)
    _, notes = pair.complete([w])
    return w, notes


def test_a_staged_write_is_scattered_before_ready():
    pair = _pair()
    c, p = pair.c[0], pair.p[0]
    w, notes = _staged(pair)
    assert w.packed is not None and w.notify.staged and w.notify.src_block_ids == (7, 2, 5)
    assert w.packed.packed.nbytes == w.plan.nbytes
    (sc,) = of(notes, Scatter)
    assert not of(notes, TransferReady) and c.state_of("t") is CS.REGISTERED
    # Both sides planned the same byte maps from the same plan.
    assert np.array_equal(sc.packed.scatter, w.packed.packed.scatter)
    assert sc.offset == w.packed.dst_offset and p.staging_lent == 0  # the write completed
    assert c.staging_lent > 0
    out = c.scatter_done("t", 0, P0, True, pair.now)
    assert [type(a) for a in out] == [ReleaseStaging, TransferReady]
    assert c.staging_lent == 0 and c.lent_blocks() == {}


def test_abort_during_a_scatter_releases_nothing_until_it_is_done():
    pair = _pair()
    c = pair.c[0]
    _staged(pair)
    acks = pair.to_producers(c.abort("t", pair.now))
    assert msgs(acks, CancelAck)  # the finished leg acknowledges at once
    out = pair.to_consumers(acks)
    assert not of(out, ReleaseDestination) and not of(out, ReleaseStaging)
    assert c.state_of("t") is CS.CANCELLING and c.lent_blocks() and c.staging_lent
    out = c.scatter_done("t", 0, P0, True, pair.now)
    assert [type(a) for a in out] == [ReleaseStaging, ReleaseDestination, TransferCancelled]
    assert c.staging_lent == 0 and c.lent_blocks() == {}


def test_the_hard_deadline_waits_for_a_scatter():
    pair = _pair()
    c = pair.c[0]
    _staged(pair)
    pair.to_consumers(pair.to_producers(c.abort("t", pair.now)))
    assert c.handle_timer(100.0) == []  # window + grace long past: the scatter still writes
    assert c.state_of("t") is CS.CANCELLING and c.staging_lent
    out = c.scatter_done("t", 0, P0, True, 100.0)
    assert of(out, ReleaseDestination) and of(out, TransferCancelled)


def test_the_producer_dying_during_a_scatter_waits_for_it():
    pair = _pair()
    c = pair.c[0]
    _staged(pair)
    assert not of(c.peer_died("P", pair.now), ReleaseDestination)
    assert c.state_of("t") is CS.FAILING
    # The scatter ends; the dead producer's writes may still land until the grace.
    assert not of(c.scatter_done("t", 0, P0, True, pair.now), ReleaseDestination)
    out = c.handle_timer(pair.now + c.config.fence_grace_s)
    assert of(out, ReleaseDestination) and of(out, TransferFailed)


def test_a_failed_scatter_fails_the_transfer_once_fenced():
    pair = _pair()
    c = pair.c[0]
    _staged(pair)
    out = c.scatter_done("t", 0, P0, False, pair.now)
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.WRITE_FAILED and "scatter" in failed.reason
    assert of(out, ReleaseStaging) and of(out, ReleaseDestination)


def test_preempt_and_reissue_during_a_scatter_keep_its_blocks_and_staging():
    pair = _pair()
    c = pair.c[0]
    _, notes = _staged(pair)
    (old,) = of(notes, Scatter)
    pair.to_consumers(pair.to_producers(c.preempt("t", pair.now)))
    assert c.state_of("t") is CS.PREEMPTING  # fenced by the producer, not by the scatter
    regs = msgs(c.reissue("t", [20, 21, 22], pair.now), Register)
    assert regs and regs[0].staging_nbytes > 0 and regs[0].staging_offset != old.offset
    assert {c.lent_to(b) for b in (3, 9, 1, 20, 21, 22)} == {("t", 0)}
    out = c.scatter_done("t", 0, P0, True, pair.now)  # the zombie's fence
    assert {type(a) for a in out} == {ReleaseStaging, ReleaseDestination}
    assert of(out, ReleaseDestination)[0].attempt == 0
    assert c.lent_to(3) is None and c.lent_to(20) == ("t", 0)


def test_a_repeated_staged_notification_scatters_once():
    pair = _pair()
    c = pair.c[0]
    w, notes = _staged(pair)
    assert of(notes, Scatter)
    assert c.receive(w.notify, pair.now) == []
    assert c.stats["duplicate"] == 1 and c.stats["scatters"] == 1


@pytest.mark.parametrize("bad", [
    {"part": 0, "parts": 2},
    {"part": 1, "parts": 2},
    {"src_block_ids": (7, 2, 5000)},
    {"src_block_ids": ()},
])
def test_a_staged_notification_that_cannot_be_one_is_rejected(bad):
    pair = _pair()
    c = pair.c[0]
    _staged(pair)  # one scatter in flight; the bad notification is another transfer's
    pair.to_producers(c.register("u", "P", [11, 12, 13], 10, pair.now))
    note = Notify(**{"transfer_id": "u", "attempt": 0, "engine_id": "P", "rank": 0,
                     "staged": True, "src_block_ids": (7, 2, 5)} | bad)
    lent = c.staging_lent
    out = c.receive(note, pair.now)
    assert [type(a) for a in out] == [Rejected] and c.state_of("u") is CS.REGISTERED
    assert c.staging_lent == lent and c.stats["scatters"] == 1


def test_no_staging_lent_means_no_staged_notification():
    pair = _pair(ck=None)
    c = pair.c[0]
    regs = msgs(c.register("t", "P", [3, 9, 1], 10, pair.now), Register)
    assert regs[0].staging_nbytes == 0
    note = Notify(transfer_id="t", attempt=0, engine_id="P", rank=0, staged=True,
                  src_block_ids=(7, 2, 5))
    assert [type(a) for a in c.receive(note, pair.now)] == [Rejected]
    assert c.state_of("t") is CS.REGISTERED


def test_the_producer_writes_directly_without_a_lent_range():
    pair = _pair(ck=None)
    c, p = pair.c[0], pair.p[0]
    pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
    (w,) = of(p.prefill_finished("t", [7, 2, 5], 10, pair.now), IssueWrite)
    assert w.packed is None and not w.notify.staged and p.stats["pack_unlent"] == 1
    _, notes = pair.complete([w])
    assert of(notes, TransferReady)


def test_never_and_auto_under_the_budget_write_directly():
    for mode in ("never", "auto"):
        pk = PackingConfig(mode=mode, staging_bytes=1 << 20)
        pair = _pair(pk=pk, ck=pk)
        c, p = pair.c[0], pair.p[0]
        pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
        (w,) = of(p.prefill_finished("t", [7, 2, 5], 10, pair.now), IssueWrite)
        assert w.packed is None
        assert of(pair.complete([w])[1], TransferReady)
        assert c.staging_lent == 0 and p.staging_lent == 0


def test_staging_exhausted_on_either_side_means_a_direct_write():
    small = PackingConfig(mode="always", staging_bytes=64)  # too small for the plan
    for pk, ck in ((small, ALWAYS), (ALWAYS, small)):
        pair = _pair(pk=pk, ck=ck)
        c, p = pair.c[0], pair.p[0]
        pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
        (w,) = of(p.prefill_finished("t", [7, 2, 5], 10, pair.now), IssueWrite)
        assert w.packed is None
        assert p.stats["pack_staging"] + p.stats["pack_unlent"] == 1
        assert of(pair.complete([w])[1], TransferReady)
        assert c.staging_lent == 0


def test_the_producer_staging_goes_back_when_the_write_fails():
    pair = _pair()
    c, p = pair.c[0], pair.p[0]
    pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
    (w,) = of(p.prefill_finished("t", [7, 2, 5], 10, pair.now), IssueWrite)
    assert p.staging_lent > 0
    p.write_completed("t", 0, w.peer, False, pair.now)
    assert p.staging_lent == 0


def test_parts_of_a_progressive_push_are_never_staged():
    pair = _pair()
    c, p = pair.c[0], pair.p[0]
    pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
    (w,) = of(p.range_ready("t", [7, 2, 5], (0, 4), pair.now), IssueWrite)
    assert w.packed is None and w.notify.parts == 0


def test_a_scatter_completion_for_no_scatter_is_refused_and_changes_nothing():
    pair = _pair()
    c = pair.c[0]
    c.register("t", "P", [3, 9, 1], 10, pair.now)
    stats = dict(c.stats)
    for attempt, peer in ((0, P0), (1, P0), (0, Peer("Q", 0))):
        with pytest.raises(LocalProtocolError):
            c.scatter_done("t", attempt, peer, True, pair.now)
    assert dict(c.stats) == stats and c.state_of("t") is CS.REGISTERED


def test_two_producer_ranks_get_disjoint_shares():
    pair = _pair(producer={"tp": 2})
    c = pair.c[0]
    regs = msgs(c.register("t", "P", [3, 9, 1], 10, pair.now), Register)
    spans = sorted((r.staging_offset, r.staging_offset + r.staging_nbytes) for r in regs)
    assert len(spans) == 2 and spans[0][1] <= spans[1][0] and all(b > a for a, b in spans)
    assert spans[1][1] - spans[0][0] <= c.staging_lent


def test_two_producer_ranks_both_scatter_then_ready():
    pair = _pair(producer={"tp": 2})
    c = pair.c[0]
    pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
    ws = [w for p in pair.p for w in of(p.prefill_finished("t", [7, 2, 5], 10, pair.now),
                                        IssueWrite)]
    assert len(ws) == 2 and all(w.packed is not None for w in ws)
    assert len({w.packed.dst_offset for w in ws}) == 2
    _, notes = pair.complete(ws)
    scatters = of(notes, Scatter)
    assert len(scatters) == 2 and not of(notes, TransferReady)
    assert not of(c.scatter_done("t", 0, scatters[0].peer, True, pair.now), TransferReady)
    assert of(c.scatter_done("t", 0, scatters[1].peer, True, pair.now), TransferReady)
    assert c.staging_lent == 0


def test_the_new_fields_travel():
    reg = Register(transfer_id="t", attempt=0, engine_id="D", rank=0, producer_engine_id="P",
                   block_ids=(1,), num_tokens=4, staging_offset=128, staging_nbytes=640)
    note = Notify(transfer_id="t", attempt=0, engine_id="P", rank=0, staged=True,
                  src_block_ids=(5, 6))
    assert decode(encode(reg)) == reg and decode(encode(note)) == note


def test_the_ledger_lends_first_fit_and_merges():
    book = StagingLedger(256)
    a, b = book.lend(10, "a"), book.lend(64, "b")
    assert (a, b) == (0, 64) and book.lent_bytes == 128
    assert book.lend(200, "c") is None
    book.give_back(a)
    assert book.lend(64, "d") == 0
    book.give_back(0)
    book.give_back(64)
    assert book.lent_bytes == 0 and book.largest_free() == 256
    with pytest.raises(LocalProtocolError):
        book.give_back(64)
    assert share(0, 256, frozenset({3, 1}), 3) == (128, 128)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=60))
def test_the_ledger_never_lends_a_byte_twice_and_gives_everything_back(ops):
    book = StagingLedger(1024)
    held: dict[int, int] = {}  # offset -> size
    for lend, n in ops:
        if lend or not held:
            at = book.lend(n, n)
            if at is None:
                assert book.largest_free() < -(-n // 64) * 64
                continue
            size = book.size_of(at)
            assert size >= n and at % 64 == 0 and at + size <= 1024
            assert all(at + size <= o or o + s <= at for o, s in held.items())
            held[at] = size
        else:
            at = sorted(held)[n % len(held)]
            book.give_back(at)
            del held[at]
        assert book.lent_bytes == sum(held.values())
    for at in list(held):
        book.give_back(at)
    assert book.lent_bytes == 0 and book.largest_free() == 1024


def test_the_window_passing_during_the_last_scatter_fails_nothing():
    pair = _pair()
    c = pair.c[0]
    _staged(pair)
    out = c.handle_timer(11.0)  # window 10 s: every write landed, one scatter runs
    assert not msgs(out, Cancel) and c.state_of("t") is CS.REGISTERED
    assert of(c.scatter_done("t", 0, P0, True, 11.0), TransferReady)


def test_the_window_passing_with_a_write_missing_fails_even_during_a_scatter():
    pair = _pair(producer={"tp": 2})
    c = pair.c[0]
    pair.to_producers(c.register("t", "P", [3, 9, 1], 10, pair.now))
    (w,) = of(pair.p[0].prefill_finished("t", [7, 2, 5], 10, pair.now), IssueWrite)
    _, notes = pair.complete([w])  # rank 0 landed and scatters; rank 1 never wrote
    assert of(notes, Scatter)
    c.handle_timer(11.0)
    assert c.state_of("t") is CS.FAILING and c.lent_blocks()
    out = c.scatter_done("t", 0, P0, True, 11.0)
    assert not of(out, ReleaseDestination)  # rank 1 is not fenced yet


# ------------------------------------------------------------- pipelined (chunks)

CHUNKED = PackingConfig(mode="always", staging_bytes=1 << 20, chunk_bytes=4096,
                        pipeline_bytes=64)


def _chunked(pair, dst=(3, 9, 1), src=(7, 2, 5), n=10):
    """Register and finish the prefill: the pipelined IssueWrite, not landed yet."""
    c, p = pair.c[0], pair.p[0]
    pair.to_producers(c.register("t", "P", list(dst), n, pair.now))
    (w,) = of(p.prefill_finished("t", list(src), n, pair.now), IssueWrite)
    assert w.packed is not None and w.packed.chunks >= 3, w.packed
    return w


def test_a_pipelined_write_scatters_chunk_by_chunk_and_is_ready_at_the_last():
    pair = _pair(pk=CHUNKED, ck=CHUNKED)
    c = pair.c[0]
    w = _chunked(pair)
    k = w.packed.chunks
    assert w.notify.chunks == k and w.notify.chunk_bytes == 64
    spans = []
    for j in reversed(range(k)):  # notifications in any order
        (sc,) = of(c.receive(w.chunk_notify(j), pair.now), Scatter)
        assert sc.chunk == j and sc.offset == w.packed.dst_offset
        spans.append(sc.span)
        assert np.array_equal(sc.packed.scatter, w.packed.packed.scatter)
    assert sorted(spans) == [w.packed.span(j) for j in range(k)]  # they tile the image
    for _ in range(k - 1):
        assert c.scatter_done("t", 0, P0, True, pair.now) == []
        assert c.state_of("t") is CS.REGISTERED
    out = c.scatter_done("t", 0, P0, True, pair.now)
    assert [type(a) for a in out] == [ReleaseStaging, TransferReady]
    assert c.staging_lent == 0 and c.lent_blocks() == {}


def test_a_repeated_chunk_scatters_once():
    pair = _pair(pk=CHUNKED, ck=CHUNKED)
    c = pair.c[0]
    w = _chunked(pair)
    assert of(c.receive(w.chunk_notify(1), pair.now), Scatter)
    assert c.receive(w.chunk_notify(1), pair.now) == []
    assert c.stats["duplicate"] == 1 and c.stats["scatters"] == 1


@pytest.mark.parametrize("bad", [
    {"chunk": 9, "chunks": 9},  # beyond the count
    {"chunk": 1, "chunks": 2},  # the chunk size cuts it into more
    {"chunk": 1, "chunk_bytes": 0},  # one chunk, but chunk 1
    {"chunk": 1, "src_block_ids": (7, 2, 6)},  # another write than chunk 0's
])
def test_a_chunk_that_cannot_be_one_is_rejected_and_changes_nothing(bad):
    import msgspec

    pair = _pair(pk=CHUNKED, ck=CHUNKED)
    c = pair.c[0]
    w = _chunked(pair)
    assert of(c.receive(w.chunk_notify(0), pair.now), Scatter)
    lent, scatters = c.staging_lent, c.stats["scatters"]
    out = c.receive(msgspec.structs.replace(w.notify, **bad), pair.now)
    assert [type(a) for a in out] == [Rejected] and c.state_of("t") is CS.REGISTERED
    assert c.staging_lent == lent and c.stats["scatters"] == scatters


def test_abort_between_chunks_waits_for_every_chunk_and_scatter():
    """Chunk 0 scattering, the transfer aborted while the write still runs: the later
    chunks are not scattered, and blocks and staging go back only once every chunk
    of the write landed (its notifications are its fence) and the scatter ended."""
    pair = _pair(pk=CHUNKED, ck=CHUNKED)
    c, p = pair.c[0], pair.p[0]
    w = _chunked(pair)
    k = w.packed.chunks
    assert of(c.receive(w.chunk_notify(0), pair.now), Scatter)
    assert not msgs(pair.to_producers(c.abort("t", pair.now)), CancelAck)  # still writing
    out = []
    for j in range(1, k - 1):
        out += c.receive(w.chunk_notify(j), pair.now)
    out += c.scatter_done("t", 0, P0, True, pair.now)
    out += pair.to_consumers(p.write_completed("t", 0, w.peer, True, pair.now))
    assert not of(out, Scatter) and not of(out, ReleaseStaging) and c.staging_lent
    assert c.state_of("t") is CS.CANCELLING
    out = c.receive(w.chunk_notify(k - 1), pair.now)  # the last chunk lands: the fence
    assert [type(a) for a in out] == [ReleaseStaging, ReleaseDestination, TransferCancelled]
    assert c.staging_lent == 0 and c.lent_blocks() == {}


def test_a_write_failing_between_chunks_is_its_fence():
    """The producer says the write failed (Fail, one posted, one failed): the chunks
    that never came are not waited for once the scatter in flight ended and the
    fence grace passed (their bytes may still land in staging until then)."""
    pair = _pair(pk=CHUNKED, ck=CHUNKED)
    c, p = pair.c[0], pair.p[0]
    w = _chunked(pair)
    assert of(c.receive(w.chunk_notify(0), pair.now), Scatter)
    fail = pair.to_consumers(p.write_completed("t", 0, w.peer, False, pair.now))
    assert not of(fail, ReleaseStaging) and c.staging_lent
    assert not of(c.scatter_done("t", 0, P0, True, pair.now), ReleaseStaging)
    out = c.handle_timer(pair.now + c.config.fence_grace_s)
    assert [type(a) for a in out] == [ReleaseStaging, ReleaseDestination, TransferFailed]
    assert c.staging_lent == 0 and p.staging_lent == 0
