"""Rule 13: pull reports that overtake the producer rank's own prefill_finished.

Behind a router the consumer learns a pull's source block ids from the prefill's
answer, while the producer rank's core is told of the finished prefill on its own
thread: a ReadDone (or a final Cancel) may reach the rank before it published.
"""

from hypothesis import given, note, settings
from hypothesis import strategies as st

from pushkv.protocol import (
    Cancel,
    Heartbeat,
    IssueWrite,
    LocalProtocolError,
    Mode,
    ProducerConfig,
    Publish,
    ReadDone,
    Register,
    Rejected,
    ReleaseSource,
    ValidationError,
)

from .helpers import Pair, of


def done(rank=0, tid="t", inc=0, attempt=0, producer="P", engine="D"):
    return ReadDone(transfer_id=tid, attempt=attempt, engine_id=engine, rank=rank,
                    producer_engine_id=producer, incarnation=inc)


def publish(p, tid="t", now=0.0, inc=0, mode=Mode.PULL):
    return p.prefill_finished(tid, [1, 2, 3], 40, now, mode=mode, incarnation=inc)


def two_readers(**pcfg):
    """One producer rank read by two consumer ranks (TP1 -> TP2, two KV heads)."""
    return Pair(producer={"num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=10.0, **pcfg))


def test_early_read_done_releases_the_source_as_it_is_published():
    (p,) = Pair(pcfg=ProducerConfig(lease_s=10.0)).p
    assert p.receive(done(), 0.0) == []
    assert p.held_blocks() == {} and p.stats["early_reports"] == 1
    out = publish(p, now=0.1)
    assert of(out, Publish) and of(out, ReleaseSource)[0].block_ids == (1, 2, 3)
    assert p.held_blocks() == {} and p.num_transfers == 0
    assert p.handle_timer(100.0) == []  # no lease left to end: released once


def test_the_source_waits_for_every_reading_rank():
    (p,) = two_readers().p
    p.receive(done(rank=0), 0.0)
    out = publish(p, now=0.1)
    assert of(out, Publish) and not of(out, ReleaseSource)
    assert of(p.receive(done(rank=1), 0.2), ReleaseSource)
    # Both early: released as it is published.
    (q,) = two_readers().p
    q.receive(done(rank=1, tid="u"), 0.0)
    q.receive(done(rank=0, tid="u"), 0.0)
    assert of(publish(q, tid="u", now=0.1), ReleaseSource)


def test_a_repeated_early_report_releases_once():
    (p,) = two_readers().p
    p.receive(done(rank=0), 0.0)
    assert p.receive(done(rank=0), 0.0) == [] and p.stats["duplicate"] == 1
    assert p.stats["early_reports"] == 1
    assert not of(publish(p, now=0.1), ReleaseSource)  # rank 1 has not read yet
    assert p.receive(done(rank=0), 0.2) == []
    assert of(p.receive(done(rank=1), 0.3), ReleaseSource)
    assert p.receive(done(rank=1), 0.4) == [] and p.receive(done(rank=0), 0.4) == []
    assert p.stats["released"] == 1


def test_early_reports_are_bounded_and_counted():
    (p,) = Pair(pcfg=ProducerConfig(lease_s=10.0, max_pending_registrations=2)).p
    for tid in ("a", "b", "c"):
        assert p.receive(done(tid=tid), 0.0) == []
    assert p.num_transfers == 2 and p.stats["early_dropped"] == 1
    assert of(publish(p, tid="a"), ReleaseSource)
    out = publish(p, tid="c")  # its report was dropped: held until its lease
    assert not of(out, ReleaseSource) and p.held_blocks()
    assert of(p.handle_timer(10.0), ReleaseSource)


def test_early_reports_past_their_ttl():
    # Forgotten after orphan_ttl_s, it is still answered from the tombstone...
    (p,) = Pair(pcfg=ProducerConfig(lease_s=10.0, orphan_ttl_s=1.0)).p
    p.receive(done(), 0.0)
    p.handle_timer(1.0)
    assert p.num_transfers == 0 and p.stats["early_expired"] == 1
    assert of(publish(p, now=2.0), ReleaseSource)
    # ...unless no tombstone is kept: then dropped, and the lease decides.
    (q,) = Pair(pcfg=ProducerConfig(lease_s=10.0, orphan_ttl_s=1.0, max_tombstones=0)).p
    q.receive(done(), 0.0)
    q.handle_timer(1.0)
    assert q.stats["early_expired"] == 1
    assert not of(publish(q, now=2.0), ReleaseSource) and q.held_blocks()
    assert of(q.handle_timer(12.0), ReleaseSource)


def test_bad_early_reports_are_rejected_without_state_change():
    (p,) = Pair().p
    for msg, match in ((done(producer="x"), "another engine"),
                       (done(engine="stranger"), "no handshake")):
        (r,) = of(p.receive(msg, 0.0), Rejected)
        assert isinstance(r.error, ValidationError) and match in str(r.error)
    # A consumer rank that reads nothing from this producer rank.
    pair = Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2})
    (r,) = of(pair.p[0].receive(done(rank=1), 0.0), Rejected)
    assert "does not read from" in str(r.error)
    for q in (p, pair.p[0]):
        assert q.num_transfers == 0 and q.stats["early_reports"] == 0
        assert not of(publish(q), ReleaseSource)


def test_an_early_report_binds_no_other_use_or_mode():
    (p,) = Pair(pcfg=ProducerConfig(lease_s=10.0)).p
    p.receive(done(inc=1), 0.0)
    assert not of(publish(p, inc=2), ReleaseSource)  # another incarnation: held
    # The same use finished as a push: the early read is void, its source is the
    # registration's to write.
    out = publish(p, inc=1, mode=Mode.PUSH)
    assert not of(out, ReleaseSource) and p.stats["early_void"] == 1
    reg = Register(transfer_id="t", attempt=0, engine_id="D", rank=0, producer_engine_id="P",
                   block_ids=(4, 5, 6), num_tokens=40, window_ms=1000, incarnation=1)
    assert of(p.receive(reg, 0.1), IssueWrite)


def test_a_registration_for_an_early_read_pull_is_refused():
    (p,) = Pair().p
    p.receive(done(), 0.0)
    reg = Register(transfer_id="t", attempt=0, engine_id="D", rank=0, producer_engine_id="P",
                   block_ids=(4, 5, 6), num_tokens=40, window_ms=1000)
    (r,) = of(p.receive(reg, 0.0), Rejected)
    assert "pull transfer" in str(r.error)


def test_an_early_final_cancel_releases_as_the_source_is_published():
    """A consumer whose read failed cancels before the rank published (this raised
    'pull transfer has push registrations' before rule 13)."""
    (p,) = two_readers().p
    p.receive(Cancel(transfer_id="t", attempt=0, engine_id="D", rank=0, final=True), 0.0)
    out = publish(p, now=0.1)
    assert of(out, Publish) and of(out, ReleaseSource) and p.num_transfers == 0


def test_an_early_heartbeat_renews_nothing():
    (p,) = Pair(pcfg=ProducerConfig(lease_s=10.0)).p
    assert p.receive(Heartbeat(engine_id="D", rank=0, transfers=(("t", 0, 0),)), 0.0) == []
    assert p.num_transfers == 0
    publish(p, now=1.0)
    assert not of(p.handle_timer(10.5), ReleaseSource)  # the lease runs from publication
    assert of(p.handle_timer(11.0), ReleaseSource)


def test_a_push_registration_is_not_read_early():
    (p,) = Pair().p
    reg = Register(transfer_id="t", attempt=0, engine_id="D", rank=0, producer_engine_id="P",
                   block_ids=(4, 5, 6), num_tokens=40, window_ms=1000)
    p.receive(reg, 0.0)
    assert p.receive(done(), 0.0) == [] and p.stats["stale"] == 1
    try:
        publish(p)
    except LocalProtocolError as exc:
        assert "push registrations" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a pull over a push registration was accepted")


@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(["publish", "r0", "r1"]), min_size=1, max_size=8))
def test_any_order_of_publication_and_reports_releases_once_when_all_are_in(events):
    """Publication and each reading rank's ReadDone, in any order, repeated: the
    source is released exactly once, at the first moment it is published and every
    reading rank reported -- never earlier, never again."""
    (p,) = two_readers().p
    seen: set[str] = set()
    released_at = None
    now = 0.0
    for i, ev in enumerate(events):
        now += 0.01
        if ev == "publish":
            if "publish" in seen:
                continue  # the engine reports a prefill once
            out = publish(p, now=now)
        else:
            out = p.receive(done(rank=int(ev[1])), now)
        seen.add(ev)
        rel = of(out, ReleaseSource)
        note(f"{ev}: {[type(a).__name__ for a in out]}")
        if rel:
            assert released_at is None, "released twice"
            released_at = i
        assert bool(rel) == (released_at == i)
        if {"publish", "r0", "r1"} <= seen:
            assert released_at is not None
        else:
            assert released_at is None, "released before every reader reported"
    assert p.stats["released"] == (released_at is not None)
