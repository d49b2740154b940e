"""Rule 11, pull: a read of part of a published source is checked against the
producer rank's digests of exactly that part, asked for over the side channel;
no answer, an unknown or a changed source fails the read (fail closed)."""

from __future__ import annotations

import pytest

from pushkv.integrity import Integrity, IntegrityConfig, Scope, seal_pull, unseal_pull
from pushkv.integrity.envelope import (
    ANSWER_CHANGED,
    ANSWER_OK,
    ANSWER_UNKNOWN,
    PullTag,
    SealAnswer,
    SealQuery,
    decode_seal_frame,
    encode_answer,
    encode_query,
)
from pushkv.protocol.errors import DecodeError
from pushkv.protocol.events import IssueRead, Peer, Publish

from .test_digest import _layout, _moved, _spec

ON = IntegrityConfig("on")
N, FIRST = 29, 8  #: a 29-token source; the consumer had tokens [0, 8) cached


def _pair(layers_read: range | None = None):
    """A producer rank that published tokens [0, N) and a consumer rank that read
    [FIRST, N) (of ``layers_read``) into its own blocks, landed exactly."""
    src, dst = _layout(block_size=16), _layout()
    sm, dm, s_part, d_part = _moved(src, dst, _spec("P", 1, 2), _spec("D", 1, 2), 0, 0, N,
                                    FIRST, seed=3)
    prod = Integrity(ON, src, lambda: sm, rank=0)
    cons = Integrity(ON, dst, lambda: dm, rank=0)
    whole = Scope(s_part.block_ids, 0, N, s_part.layers, ((0, 0, src.num_heads),))
    seal = prod.publish_seal(Publish(transfer_id="t", block_ids=whole.block_ids,
                                     num_tokens=N, incarnation=7, scope=whole))
    cons.expect_pull("t", 7, Integrity.pull_seals({0: seal}, [0]))
    scope = d_part if layers_read is None else Scope(
        d_part.block_ids, FIRST, N, layers_read, d_part.heads)
    read = IssueRead(transfer_id="t", attempt=0, peer=Peer("P", 0), plan=None,  # type: ignore[arg-type]
                     incarnation=7, scope=scope)
    return prod, cons, read, (sm, whole.block_ids[0] * src.block_bytes), dm


def _ask(prod, cons, read):
    q = cons.seal_query(read, "D")
    assert q is not None and cons.awaiting(read)
    ans = prod.answer(decode_seal_frame(encode_query(q)))  # over the wire
    assert cons.answered(decode_seal_frame(encode_answer(ans)))
    assert not cons.awaiting(read)
    return ans


@pytest.mark.parametrize("layers", [None, range(1, 2)], ids=["prefix remainder",
                                                            "layer subset"])
def test_a_read_of_part_of_a_source_is_checked_against_the_answer(layers):
    prod, cons, read, _, _ = _pair(layers)
    ans = _ask(prod, cons, read)
    assert ans.status == ANSWER_OK
    tag = unseal_pull(ans.seal)
    assert (tag.first_token, tag.num_tokens) == (FIRST, N)
    assert cons.read_landed(read) == ""
    assert cons.stats["checked"] == cons.stats["passed"] == 1 and not cons.stats["unchecked"]
    assert prod.stats["queries_answered"] == 1


def test_wrong_landed_bytes_in_the_part_fail_the_read():
    prod, cons, read, _, dm = _pair()
    _ask(prod, cons, read)
    b = read.scope.block_ids[FIRST // 4]  # a block holding tokens of the part read
    dm[0][b * _layout().block_bytes] ^= 1
    assert "failed its digest check" in cons.read_landed(read)
    assert cons.stats["corrupt"] == 1


def test_a_source_changed_since_it_was_sealed_fails_the_read():
    """The producer's engine reused a block it had published: the answer says so,
    although the consumer read (and would digest) the same changed bytes."""
    prod, cons, read, (sm, at), _ = _pair()
    sm[0][at + 3] ^= 0x40  # in the source's first block: the prefix the consumer did not read
    ans = _ask(prod, cons, read)
    assert ans.status == ANSWER_CHANGED and prod.stats["source_changed"] == 1
    assert "changed since it sealed it" in cons.read_landed(read)
    assert cons.stats["unverified"] == 1


def test_no_answer_or_an_unknown_source_fails_the_read():
    _, cons, read, _, _ = _pair()
    assert cons.seal_query(read, "D") is not None
    assert "no answer" in cons.read_landed(read)  # the wait ended without one
    prod2, cons2, read2, _, _ = _pair()
    prod2.forget_source("t", 7)  # released (or forgotten) before the query came
    assert _ask(prod2, cons2, read2).status == ANSWER_UNKNOWN
    assert "holds no such sealed source" in cons2.read_landed(read2)


def test_an_answer_nobody_asked_for_is_dropped():
    prod, cons, read, _, _ = _pair()
    assert not cons.answered(SealAnswer("t", 7, 0, 0, ANSWER_UNKNOWN))
    _ask(prod, cons, read)
    assert not cons.answered(SealAnswer("t", 7, 0, 0, ANSWER_UNKNOWN))  # a repeat
    assert cons.stats["answers_stale"] == 2
    assert cons.read_landed(read) == ""


def test_a_whole_read_asks_nothing():
    _, cons, read, _, _ = _pair()
    whole = IssueRead(transfer_id="t", attempt=0, peer=Peer("P", 0), plan=None,  # type: ignore[arg-type]
                      incarnation=7, scope=Scope(read.scope.block_ids, 0, N,
                                                 read.scope.layers, read.scope.heads))
    assert cons.seal_query(whole, "D") is None
    off = Integrity(IntegrityConfig("off"), _layout(), lambda: [])
    assert off.seal_query(read, "D") is None


def test_the_frames_round_trip_and_malformed_ones_are_refused():
    q = SealQuery("t", 2**63, 3, "decode-0", 5, 16, 40, range(0, 2))
    assert decode_seal_frame(encode_query(q)) == q
    tag = seal_pull(PullTag(16, 40, range(0, 2), (1, 2)))
    a = SealAnswer("t", 1, 0, 2, ANSWER_OK, tag)
    assert decode_seal_frame(encode_answer(a)) == a
    u = SealAnswer("t", 1, 0, 2, ANSWER_CHANGED)
    assert decode_seal_frame(encode_answer(u)) == u
    bad = [
        b"", b"PQ", b"XX" + encode_query(q)[2:],
        encode_query(q)[:-1],                                   # torn engine id
        encode_query(q) + b"\0",                                # trailing bytes
        encode_query(SealQuery("t", 1, 0, "d", 0, 40, 40, range(0, 2))),  # empty range
        encode_query(q)[:2] + b"\x09" + encode_query(q)[3:],    # version
        encode_answer(a)[:-1],                                  # torn seal
        encode_answer(SealAnswer("t", 1, 0, 2, 9)),             # unknown status
        encode_answer(u) + b"x",                                # a seal with no OK
    ]
    for raw in bad:
        with pytest.raises(DecodeError):
            decode_seal_frame(raw)
