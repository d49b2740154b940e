"""Everything that decides a transition, in one place.

Theory of operation
===================

A transfer moves one request's KV from the producer (prefill) engine to the
consumer (decode) engine. It is named by ``(transfer_id, incarnation)``: the
incarnation tells one use of an id from the next, so nothing of an ended use
(message, notification, timer, tombstone) ever touches a new one. Each
*producer rank* keeps one **source** per transfer and one **leg** per consumer
rank it writes into; each *consumer rank* keeps one **transfer** record and
its **zombie** attempts. The five tables below (``PRODUCER_TABLE``,
``SOURCE_TABLE``, ``CONSUMER_TABLE``, ``ZOMBIE_TABLE``) are the whole
behaviour: the endpoints only classify their inputs, look them up here and
carry out the named effects, and can record every transition they make
(``Endpoint.trace``). The state diagrams in the docs are drawn from these tables.

Producer leg (push)::

    EMPTY --register--> REGISTERED --kv ready--> WRITING --write ok--> DONE
    EMPTY --kv ready--> KV_READY  --register--> WRITING

Rule 1 -- **either-order rendezvous.** A write is issued when a leg holds a
registration *and* the transfer's KV is ready, whichever came second:
``(REGISTERED, KV_READY)`` and ``(KV_READY, REGISTER)`` both issue the write.
KV readiness is a property of the transfer; the endpoint feeds ``KV_READY``
to every leg when prefill finishes, and a leg created later starts in
``KV_READY`` instead of ``EMPTY``.

Rule 2 -- **attempts.** The consumer owns the attempt number. A Register or
Cancel whose attempt is older than the leg's newest (stale) or repeats it is
the input ``REGISTER_STALE`` / ``CANCEL_STALE`` and changes nothing, but such a
cancel is acknowledged (``ACK_STALE``): an attempt older than the leg's newest
can never be written any more, unless it is the write in flight, whose
completion is its fence. A cancel also fences the older registration it makes
the leg drop. Only newer ones are ``REGISTER`` /
``CANCEL`` / ``PREEMPT``. A newer Register while the old attempt is being written
is *stashed* (``SUPERSEDED``) and written only after the old write finished:
the old write is fenced before the new one starts. A newer Register before
any write acknowledges the old attempt at once (``CancelAck``).

Rule 3 -- **reopen, and answers from memory.** A newer attempt for a finished
leg reopens it (``REOPEN`` -> ``EMPTY``, then ``KV_READY`` if the source is
held). When the source is gone every leg ends in ``GONE``; a forgotten
transfer is kept, per incarnation, as a tombstone whose legs are ``GONE``, and
a registration reaching a ``GONE`` leg -- even from a consumer rank whose leg
never existed -- is failed at once with ``SOURCE_RELEASED`` (or
``PREFILL_ABORTED``), never dropped: known answers are given, not waited out.

Rule 4 -- **release.** The transfer's source (``SOURCE_TABLE``) is released
exactly once, when no leg is writing and either every expected leg has
finished, a final cancel or a Skip arrived, the lease expired, or the local
engine aborted the request (the derived input ``SETTLED``). A producer rank
that writes nothing into the consumer engine (replicated heads, MLA, producer
TP above consumer TP) learns so from one consumer rank's ``Skip`` and
releases as soon as prefill finished. A published pull source is read by its
consumer with READs that take its bytes until they complete, so a local abort
does not release it: it waits for the ReadDone, a final cancel or its lease;
and the consumer, told the lease at publication, fails closed a read that
completes after it (``LEASE_EXPIRED``). An *orphan* -- a source a peer spoke of
before prefill finished -- is forgotten after ``orphan_ttl_s`` unless someone
waits for it (``ORPHAN_EXPIRED``).

Rule 5 -- **deadlines.** A registration must be written within its window
and while the source's lease lasts: the producer never *starts* a write after
either (``WRITE_REFUSED``: ``DEADLINE`` or ``LEASE_EXPIRED``), nor after the
local request was aborted. The lease timer runs while a write is in flight; a
stash still waiting when the lease ends is failed then (``LEASE_EXPIRED``).
Source KV is held under a lease renewed by heartbeats; a lease never cuts a
write short.

Consumer transfer::

    CONNECTING --connected--> REGISTERED --all notified--> READY
    REGISTERED --fail / deadline / peer died--> FAILING --fenced--> FAILED
    REGISTERED --abort--> CANCELLING --fenced--> CANCELLED
    REGISTERED --preempt--> PREEMPTING --fenced--> PREEMPTED --reissue--> REGISTERED

Rule 6 -- **counting.** ``NOTIFY`` records one producer rank for the current
attempt; the endpoint feeds ``ALL_NOTIFIED`` once every producer rank the
mapping assigns has notified. Notifications of other attempts or other
incarnations, and duplicates, are the input ``STALE`` and never count;
ranks that are not expected are rejected.

Rule 7 -- **fences.** Destination blocks are released only when no write of
the attempt can land any more. A producer's local completion proves nothing
at the destination: a write's bytes may land at any time, in pieces, until its
notification is delivered, and a CancelAck or Fail may overtake them. So a
rank's word (CancelAck, Fail) says how many writes of the attempt it *posted*
and how many of those *failed*; the rank is fenced once the notifications of
the others arrived and, when one failed (its bytes may land in part, and it
may never notify), once the fence grace passed after that word (``GRACE``).
A rank declared dead by the transport fences at once; the hard deadline
(window + grace) fences every rank, which the producer honours by never
starting a write after the window. The endpoint
feeds ``FENCED`` when the last rank is fenced. An attempt abandoned by a
reissue keeps its own fence (a *zombie*, ``ZOMBIE_TABLE``) and releases its
blocks on its own.

Rule 8 -- **handshake in the core.** A registration for a producer engine this
rank cannot use yet (not every producer rank that writes into it has handshaken)
waits in ``CONNECTING`` with its blocks lent; the consumer emits ``Connect``
once per engine, the handshake's completion (``CONNECTED``) sends it, and a
failed or timed-out handshake (``handshake_timeout_s``) fails it with
``HANDSHAKE_FAILED``. Preempting, reissuing and aborting while waiting are rows.

Rule 9 -- **partial readiness.** Before prefill finished the engine may report
ranges (tokens x layers) of the KV as final (``SourceInput.RANGE_READY``: the
source turns ``PARTIAL``, held for the writes). A registered leg writes what
is ready, one write at a time (``RANGE_READY``, ``PART_OK``; ``NOTHING_READY``
parks it in ``REGISTERED``); ``KV_READY`` on a leg means "some KV ready, no
registration"; a leg left without a registration, or given a fresh one, while
ranges are ready is fed ``RANGE_READY`` (derived, as a new leg starts in
``KV_READY``). Each write is a numbered part; the last one carries the count,
and a CancelAck or Fail for a partly written attempt carries the parts that
finished, sent only once no part is in flight (``ACK_PARTS``). The consumer
counts parts (``PART``) and takes a rank's outcome -- notified or fenced --
only when all its parts' notifications arrived. Whole-request push is the
case with no range: one write, part 0 of 1.

Rule 10 -- **packed writes.** A consumer rank with staging memory lends a
range of it to each attempt (``Register`` names each producer rank's share);
a producer rank with staging of its own may pack a whole-request write (part
0 of 1) into it (:func:`~.packing.choose`) and marks the notification
``staged``, with its source block ids, so the consumer plans the same
:class:`~.packing.PackedPlan`. A staged notification of the current,
registered attempt is ``STAGED``: the consumer scatters it (``Scatter``) and
counts the rank only when the scatter is done (``SCATTER_DONE``; a failed
scatter fails the transfer like a failed write). An attempt with a scatter
still running is not fenced, whatever the producers say -- a cancel, a
preemption, a failure, an abort, a reissue (the zombie keeps it) or the hard
deadline (``HARD_DEADLINE_SCATTERING`` only fences the producers) all wait
for the scatter before its blocks or its staging go back; the window passing
once every write landed (``DEADLINE_SCATTERING``) fails nothing: the window
bounds the producers' writes, not the consumer's scatters. Staging is lent
and fenced like destination blocks: released with them (or at READY), never
while a write into it may still land. A staged write that lands once the
attempt is being fenced, or in a zombie, is not scattered: it is its fence.
A staged write may be *pipelined*: cut into chunks (:func:`~.packing.chunk_bounds`
at the producer's ``pipeline_bytes``), each gathered, written and notified on its
own (``Notify.chunk`` of ``chunks``). Each chunk notification of the registered
attempt is ``STAGED`` and scatters that chunk alone (checked against the lent
share and the rank's earlier chunks); a chunk scattered that is not the rank's
last is ``CHUNK_SCATTERED`` and changes nothing, the last is ``SCATTER_DONE``
and counts the rank. A rank's staged write is landed (its fence) only once every
chunk notified -- or its producer said the write did not finish -- so a chunk
that lands while the attempt is being fenced, or in a zombie, is recorded and
never scattered, and the attempt is fenced only when no chunk scatter runs and no
chunk of a finished write is still owed.

Rule 11 -- **integrity.** A driver that checks digests (:mod:`pushkv.integrity`)
verifies a write's landed bytes -- a direct write's at its notification, a staged
write's once its last chunk is scattered -- before the core hears of it, and
reports a mismatch instead (``Consumer.corrupt``, ``scatter_done(corrupt=)``).
For the registered attempt that is ``CORRUPT``: the landing is recorded as a
landing (it fences its rank once all its parts are in, like a notification), it
never counts towards READY, and the transfer fails (``FailReason.CORRUPT``,
blocks released at the fence, nothing READY). Where the attempt is already being
fenced, or is a zombie, a corrupt landing is only a landing: its fence.

Rule 12 -- **re-target a held source.** A source is bound to the consumer
engine that first registered (or skipped) it, at that engine's *turn*
(``Register.target``, 0 for the first choice). A Register from another engine
with a later turn re-targets the source: every leg of the engine bound before
takes ``RETARGET`` -- a leg not written yet ends at once (a registered one is
failed with ``RETARGETED``, the counts of its attempt), a leg whose write is in
flight is failed the same way and waits in ``CANCELLING`` for its completion
(its fence: the source is released only after it, rule 4) -- and the new
engine's legs proceed as any first registration would (rule 1). A Register or
Cancel from an engine that is no longer (or never was) bound changes nothing:
an earlier turn's Register is failed with ``RETARGETED``, a Cancel is answered
from the leg's history; neither reopens a leg nor releases the source. The
source is written once per turn; prefill computes it once. With
``retarget_hold_s``, a push source written whole to its live bound engine
*lingers* (held, its legs ``DONE``) until that engine reports its first decode
step (``Consumed``, from a rank it wrote into), the hold or the lease ends: an
engine lost between READY and its first token is re-targeted like any other
(its legs are finished and stay so), not computed again. A ``Consumed`` from an
engine the source is not bound to, or for a source not held here, changes
nothing; a final cancel, an abort or an expired lease end a linger at once.

Rule 13 -- **early pull reports.** A pull's block ids may reach the consumer
before this rank's core is told the prefill finished (a router relays the
prefill's own answer, made once the bytes are final, while the core learns of it
on another thread). So a consumer rank's ``ReadDone`` or final ``Cancel`` may
arrive for a transfer the rank has not published yet. Like a cancel that
overtook its registration, it is kept on an *orphan* (bounded by
``max_pending_registrations``, forgotten after ``orphan_ttl_s``, counted either
way): ``(EMPTY, READ_DONE)`` ends the leg ``DONE`` at once, a final cancel ends it
``CANCELLED`` and makes the source final. When ``prefill_finished(mode=PULL)``
comes, the source is published and released as soon as every reading rank's
report is in (rule 4) -- once, however often a report was repeated (a repeat finds
the leg finished). A ReadDone is validated as a late one would be (another
producer engine, a rank that does not read from this one: a typed error, nothing
kept), and counts only on an orphan no push registration was ever adopted for
(legs ``EMPTY``, ``DONE`` or ``CANCELLED``): such an orphan is a pull, and a
``Register`` for it is refused. If the rank then finishes that use as a *push*,
the early reads are void (their legs are dropped, counted ``early_void``): a
push source is released only by its own legs. A Heartbeat for a transfer not
published yet renews nothing (it renews an orphan's TTL): the lease starts when
the source is published, later than any renewal it could give.
"""

from __future__ import annotations

import enum

from .errors import LocalProtocolError


class ProducerState(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    EMPTY = "EMPTY"  #: no registration, KV not ready
    REGISTERED = "REGISTERED"  #: registration held, KV not ready
    KV_READY = "KV_READY"  #: KV ready, no registration (pull: published)
    WRITING = "WRITING"  #: the write of the current attempt is in flight
    SUPERSEDED = "SUPERSEDED"  #: an old write in flight, a newer registration stashed
    CANCELLING = "CANCELLING"  #: cancelled while writing; the completion is the fence
    PREEMPTING = "PREEMPTING"  #: preempted while writing; then parked in KV_READY
    DONE = "DONE"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"
    FAILED = "FAILED"
    GONE = "GONE"  #: the source is released or aborted: the leg answers from memory


class ProducerInput(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    REGISTER = "REGISTER"  #: a newer attempt's registration
    KV_READY = "KV_READY"  #: prefill finished, source KV held
    KV_ABORTED = "KV_ABORTED"  #: the local engine aborted the request
    WRITE_OK = "WRITE_OK"
    WRITE_ERROR = "WRITE_ERROR"
    CANCEL = "CANCEL"  #: final cancel (consumer aborted)
    PREEMPT = "PREEMPT"  #: non-final cancel (consumer preempted; may reissue)
    DEADLINE = "DEADLINE"  #: the registration's window passed
    LEASE_EXPIRED = "LEASE_EXPIRED"
    PEER_DIED = "PEER_DIED"  #: the transport lost the consumer engine
    READ_DONE = "READ_DONE"  #: pull: the consumer rank read its slice
    REGISTER_STALE = "REGISTER_STALE"  #: a registration of an older (or the same) attempt
    CANCEL_STALE = "CANCEL_STALE"  #: a cancel of an older attempt, or a repeated one
    REOPEN = "REOPEN"  #: a newer registration for a finished leg (rule 3)
    SOURCE_GONE = "SOURCE_GONE"  #: the transfer's source was released or aborted
    WRITE_REFUSED = "WRITE_REFUSED"  #: rule 5: the window, the lease or the request ended
    PLAN_FAILED = "PLAN_FAILED"  #: the registration cannot be planned against the source
    RANGE_READY = "RANGE_READY"  #: rule 9: part of the KV became final before prefill finished
    PART_OK = "PART_OK"  #: rule 9: a write that is not the leg's last finished
    NOTHING_READY = "NOTHING_READY"  #: rule 9: a write would start, nothing new is ready yet
    RETARGET = "RETARGET"  #: rule 12: the source was re-targeted to another consumer engine


class ProducerEffect(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    NONE = "none"
    ADOPT = "adopt"  #: keep the registration
    ADOPT_AND_WRITE = "adopt+write"
    WRITE = "write"  #: issue the write of the held registration
    ACK = "ack"  #: CancelAck the cancelled attempt (unless it is being written) and any stash
    ACK_AND_ADOPT = "ack old+adopt"
    FAIL = "fail"  #: send Fail for the leg's attempt
    STASH = "stash"  #: keep the newer registration until the write completes
    WRITE_STASHED = "write stashed"
    FAIL_AND_WRITE_STASHED = "fail old+write stashed"
    ACK_STASHED_AND_STASH = "ack stashed+stash"
    FAIL_STASHED = "fail stashed"
    STALE = "drop stale"  #: count the message, answer nothing
    ACK_STALE = "ack stale"  #: CancelAck an older attempt (never written now) unless in flight
    FAIL_GONE = "fail: source gone"  #: Fail(SOURCE_RELEASED or PREFILL_ABORTED)
    ACK_PARTS = "ack parts"  #: CancelAck the attempt just written, with its count of parts
    ACK_PARTS_AND_WRITE_STASHED = "ack parts+write stashed"


class SourceState(enum.Enum):
    """Where a transfer's source KV stands on one producer rank."""

    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    PENDING = "pending"  #: prefill not finished (a peer's message made it: an orphan)
    PARTIAL = "partial"  #: prefill running, some ranges final: blocks held for their writes
    HELD = "held"  #: blocks held for the transfer, under a lease
    RELEASED = "released"  #: ReleaseSource emitted (or never held and forgotten)
    ABORTED = "aborted"  #: the local request ended before prefill finished


class SourceInput(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    PREFILL_DONE = "PREFILL_DONE"
    RANGE_READY = "RANGE_READY"  #: rule 9: tokens x layers became final before prefill finished
    PREFILL_ABORTED = "PREFILL_ABORTED"
    LEASE_EXPIRED = "LEASE_EXPIRED"  #: no heartbeat renewed the lease in time
    ORPHAN_EXPIRED = "ORPHAN_EXPIRED"  #: before prefill, nobody registered within the TTL
    SETTLED = "SETTLED"  #: derived, rule 4: no leg writing, and the transfer is over here


class SourceEffect(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    HOLD = "hold+lease"  #: arm the lease; every leg gets KV_READY (rule 1)
    ABORT = "abort legs"  #: every leg gets KV_ABORTED
    EXPIRE = "expire legs"  #: every leg gets LEASE_EXPIRED
    RELEASE = "release"  #: ReleaseSource, once; then every leg ends (SOURCE_GONE)
    FORGET = "forget"  #: waiting legs expire, then every leg ends (SOURCE_GONE)
    STREAM = "stream"  #: record the range; every leg gets RANGE_READY (rule 9)


class ConsumerState(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    CONNECTING = "CONNECTING"  #: blocks lent, waiting for the producer engine's handshake
    REGISTERED = "REGISTERED"  #: waiting for notifications (pull: reads)
    READY = "READY"
    PREEMPTING = "PREEMPTING"  #: waiting for the fence before releasing blocks
    PREEMPTED = "PREEMPTED"  #: blocks released, waiting for a reissue
    CANCELLING = "CANCELLING"
    CANCELLED = "CANCELLED"
    FAILING = "FAILING"
    FAILED = "FAILED"


class ConsumerInput(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    NOTIFY = "NOTIFY"  #: an expected producer rank finished (pull: our read finished)
    ALL_NOTIFIED = "ALL_NOTIFIED"  #: derived: every expected rank notified
    FAIL = "FAIL"  #: a producer rank failed (pull: our read failed)
    CANCEL_ACK = "CANCEL_ACK"
    FENCED = "FENCED"  #: derived: no write of the attempt can land any more
    ABORT = "ABORT"
    PREEMPT = "PREEMPT"
    REISSUE = "REISSUE"
    DEADLINE = "DEADLINE"  #: the window passed without READY
    HARD_DEADLINE = "HARD_DEADLINE"  #: window + grace: release without a fence
    PEER_DIED = "PEER_DIED"
    CONNECTED = "CONNECTED"  #: the producer engine became usable (every rank handshaken)
    HANDSHAKE_FAILED = "HANDSHAKE_FAILED"  #: the driver gave up, or the handshake timed out
    REISSUE_CONNECTING = "REISSUE_CONNECTING"  #: a reissue while the engine is not usable
    STALE = "STALE"  #: a producer message of another attempt, or a repeat: it never counts
    PART = "PART"  #: rule 9: a write notified, but not the rank's last (or its count is owed)
    STAGED = "STAGED"  #: rule 10: a rank's staged write landed in our staging
    SCATTER_DONE = "SCATTER_DONE"  #: rule 10: its scatter into the blocks finished
    SCATTER_FAILED = "SCATTER_FAILED"  #: rule 10: its scatter failed
    #: Rule 10: the hard deadline passed while a scatter still writes the blocks.
    HARD_DEADLINE_SCATTERING = "HARD_DEADLINE_SCATTERING"
    #: Rule 10: the window passed, but every write landed: only scatters remain.
    DEADLINE_SCATTERING = "DEADLINE_SCATTERING"
    #: Rule 10: one chunk of a pipelined staged write scattered, not the rank's last.
    CHUNK_SCATTERED = "CHUNK_SCATTERED"
    #: Rule 7: the fence grace of a rank's failed write passed: no stray byte lands now.
    GRACE = "GRACE"
    #: Rule 11: a rank's landed bytes failed their digest check.
    CORRUPT = "CORRUPT"


class ConsumerEffect(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    NONE = "none"
    COUNT = "count"  #: record the notification
    READY = "ready"  #: declare the transfer ready (pull: send ReadDone)
    FENCE = "fence"  #: record the rank as fenced
    FAIL_REST = "fence+cancel rest"  #: fence the failing rank, cancel the others
    CANCEL_ALL = "cancel all"  #: final Cancel to every expected rank
    PREEMPT_ALL = "preempt all"  #: non-final Cancel to every expected rank
    RELEASE = "release"  #: release blocks (preempted: await reissue)
    RELEASE_CANCELLED = "release+cancelled"
    RELEASE_FAILED = "release+failed"
    REGISTER = "register"  #: register a new attempt
    ZOMBIFY_AND_REGISTER = "zombify+register"  #: old attempt keeps its fence
    FINAL_CANCEL_RELEASED = "final cancel+cancelled"  #: blocks already released
    REPORT_FAILED = "failed"  #: blocks already released: only report the failure
    SEND_HELD = "send held registration"  #: the engine is usable: register the attempt
    HOLD = "hold+connect"  #: a new attempt waits for the handshake (Connect once per engine)
    DROP = "drop stale"  #: count the message, change nothing
    PART = "count part"  #: rule 9: the part is recorded; the rank is not finished yet
    SCATTER = "scatter"  #: rule 10: scatter the staged write; the rank counts once it is done
    FENCE_REMOTE = "fence producers"  #: rule 10: no producer write lands; the scatter fences


class ZombieState(enum.Enum):
    """An attempt abandoned by a reissue before its fence (rule 7)."""

    __hash__ = object.__hash__  # members are singletons: hash by identity, fast

    FENCING = "FENCING"  #: its blocks stay lent until every expected rank is fenced
    RELEASED = "RELEASED"  #: fenced; its blocks went back


P, PI, PE = ProducerState, ProducerInput, ProducerEffect
C, CI, CE = ConsumerState, ConsumerInput, ConsumerEffect

# Tuples, not sets, where tables are built: the table order (and so the
# generated docs) must not depend on hashing.
_P_FINISHED = (P.DONE, P.CANCELLED, P.EXPIRED, P.FAILED)
_P_TERMINAL = (*_P_FINISHED, P.GONE)
_P_WRITING = (P.WRITING, P.SUPERSEDED, P.CANCELLING, P.PREEMPTING)
_P_ALL = tuple(P)
PRODUCER_TERMINAL = frozenset(_P_TERMINAL)
#: Finished legs a newer registration may reopen (rule 3).
PRODUCER_FINISHED = frozenset(_P_FINISHED)
#: States in which a write of the leg may be in flight.
PRODUCER_WRITING = frozenset(_P_WRITING)
#: Rule 13: the legs an orphan may hold and still be a pull (no push registration
#: was adopted): untouched or preempted, read early, cancelled early.
EARLY_PULL_LEGS = frozenset((P.EMPTY, P.DONE, P.CANCELLED))

# Transfer-wide inputs reach every leg; a leg writing or finished ignores them
# (a lease never cuts a write short; rule 4 releases after the write).
_quiet_when_writing = {
    (s, i): (PE.NONE, s)
    for s in _P_WRITING
    for i in (PI.KV_ABORTED, PI.LEASE_EXPIRED, PI.PEER_DIED)
}
_quiet_when_finished = {
    (s, i): (PE.NONE, s)
    for s in _P_FINISHED
    for i in (PI.KV_ABORTED, PI.LEASE_EXPIRED, PI.PEER_DIED)
}
_ack_when_terminal = {
    (s, i): (PE.ACK, s) for s in _P_TERMINAL for i in (PI.CANCEL, PI.PREEMPT)
}
# Rule 2: stale and repeated messages are inputs too; they change nothing. An
# older attempt can never be written any more, so its cancel is acknowledged at
# once (unless that very attempt is being written: its completion is the fence).
_stale = {(s, PI.REGISTER_STALE): (PE.STALE, s) for s in _P_ALL}
_stale |= {(s, PI.CANCEL_STALE): (PE.ACK_STALE, s) for s in _P_ALL}
# Rule 3: reopen a finished leg as a new one would start; rule 4: when the
# source goes, every leg that is not writing ends in GONE.
_reopen = {(s, PI.REOPEN): (PE.NONE, P.EMPTY) for s in _P_FINISHED}
_gone = {(s, PI.SOURCE_GONE): (PE.NONE, P.GONE) for s in (P.KV_READY, *_P_FINISHED)}

# Rule 9: partial readiness. KV_READY means "some KV is ready, no registration";
# a registered leg writes what is ready, one write at a time; a write that is
# not the leg's last (PART_OK) is followed by the next one, or waits in
# REGISTERED when nothing new is ready. A part that ends an attempt the
# consumer dropped (cancel, preempt, newer registration) is acknowledged with
# the number of parts written, which the consumer waits for before its fence.
_ranges = {
    (P.EMPTY, PI.RANGE_READY): (PE.NONE, P.KV_READY),
    (P.REGISTERED, PI.RANGE_READY): (PE.WRITE, P.WRITING),
    (P.WRITING, PI.NOTHING_READY): (PE.NONE, P.REGISTERED),
    (P.WRITING, PI.PART_OK): (PE.WRITE, P.WRITING),
    (P.SUPERSEDED, PI.PART_OK): (PE.ACK_PARTS_AND_WRITE_STASHED, P.WRITING),
    (P.CANCELLING, PI.PART_OK): (PE.ACK_PARTS, P.CANCELLED),
    (P.PREEMPTING, PI.PART_OK): (PE.ACK_PARTS, P.KV_READY),
    # The rest of the KV turns up at a leg already writing (the next part picks
    # it up), parked, or finished: nothing to do now.
    (P.KV_READY, PI.KV_READY): (PE.NONE, P.KV_READY),
    **{(s, i): (PE.NONE, s)
       for s in (P.KV_READY, *_P_WRITING, *_P_FINISHED)
       for i in (PI.RANGE_READY, PI.KV_READY)
       if (s, i) not in ((P.CANCELLED, PI.KV_READY), (P.EXPIRED, PI.KV_READY))},
}

# Rule 12: the legs of the engine a source was re-targeted away from. A leg with
# a write in flight is failed now (the counts of its attempt, the write in flight
# among them) and fences at the write's completion; a finished leg stays as it is.
_retarget = {
    (P.EMPTY, PI.RETARGET): (PE.NONE, P.CANCELLED),
    (P.REGISTERED, PI.RETARGET): (PE.FAIL, P.FAILED),
    (P.KV_READY, PI.RETARGET): (PE.NONE, P.CANCELLED),
    (P.WRITING, PI.RETARGET): (PE.FAIL, P.CANCELLING),
    (P.SUPERSEDED, PI.RETARGET): (PE.FAIL_STASHED, P.CANCELLING),
    (P.CANCELLING, PI.RETARGET): (PE.NONE, P.CANCELLING),
    (P.PREEMPTING, PI.RETARGET): (PE.NONE, P.CANCELLING),
    # (GONE legs belong to forgotten sources, which are never re-targeted.)
    **{(s, PI.RETARGET): (PE.NONE, s) for s in _P_FINISHED},
}

S, SI, SE = SourceState, SourceInput, SourceEffect
#: The source of one transfer on one producer rank (rule 4; orphans are PENDING).
SOURCE_TABLE: dict[tuple[SourceState, SourceInput], tuple[SourceEffect, SourceState]] = {
    (S.PENDING, SI.PREFILL_DONE): (SE.HOLD, S.HELD),
    (S.PENDING, SI.PREFILL_ABORTED): (SE.ABORT, S.ABORTED),
    (S.PENDING, SI.ORPHAN_EXPIRED): (SE.FORGET, S.RELEASED),
    (S.HELD, SI.PREFILL_ABORTED): (SE.ABORT, S.HELD),  # released once no write is in flight
    (S.HELD, SI.LEASE_EXPIRED): (SE.EXPIRE, S.HELD),  # likewise: a lease never cuts a write
    (S.HELD, SI.SETTLED): (SE.RELEASE, S.RELEASED),
    # Rule 9: ranges final before prefill finished are written at once; the
    # blocks are held for those writes from the first range on, so an abort
    # releases them only once no write is in flight (like a held source).
    (S.PENDING, SI.RANGE_READY): (SE.STREAM, S.PARTIAL),
    (S.PARTIAL, SI.RANGE_READY): (SE.STREAM, S.PARTIAL),
    (S.PARTIAL, SI.PREFILL_DONE): (SE.HOLD, S.HELD),
    (S.PARTIAL, SI.PREFILL_ABORTED): (SE.ABORT, S.HELD),
}

PRODUCER_TABLE: dict[
    tuple[ProducerState, ProducerInput], tuple[ProducerEffect, ProducerState]
] = {
    (P.EMPTY, PI.REGISTER): (PE.ADOPT, P.REGISTERED),
    (P.EMPTY, PI.KV_READY): (PE.NONE, P.KV_READY),
    (P.EMPTY, PI.KV_ABORTED): (PE.NONE, P.CANCELLED),
    (P.EMPTY, PI.CANCEL): (PE.ACK, P.CANCELLED),
    (P.EMPTY, PI.PREEMPT): (PE.ACK, P.EMPTY),
    (P.EMPTY, PI.PEER_DIED): (PE.NONE, P.CANCELLED),
    (P.EMPTY, PI.DEADLINE): (PE.NONE, P.EXPIRED),
    (P.REGISTERED, PI.KV_READY): (PE.WRITE, P.WRITING),  # rule 1
    (P.REGISTERED, PI.REGISTER): (PE.ACK_AND_ADOPT, P.REGISTERED),  # rule 2
    (P.REGISTERED, PI.CANCEL): (PE.ACK, P.CANCELLED),
    (P.REGISTERED, PI.PREEMPT): (PE.ACK, P.EMPTY),
    (P.REGISTERED, PI.KV_ABORTED): (PE.FAIL, P.FAILED),
    (P.REGISTERED, PI.DEADLINE): (PE.FAIL, P.EXPIRED),
    (P.REGISTERED, PI.PEER_DIED): (PE.NONE, P.CANCELLED),
    (P.KV_READY, PI.REGISTER): (PE.ADOPT_AND_WRITE, P.WRITING),  # rule 1
    (P.KV_READY, PI.CANCEL): (PE.ACK, P.CANCELLED),
    (P.KV_READY, PI.PREEMPT): (PE.ACK, P.KV_READY),
    (P.KV_READY, PI.KV_ABORTED): (PE.NONE, P.CANCELLED),
    (P.KV_READY, PI.LEASE_EXPIRED): (PE.NONE, P.EXPIRED),
    (P.KV_READY, PI.PEER_DIED): (PE.NONE, P.CANCELLED),
    (P.KV_READY, PI.READ_DONE): (PE.NONE, P.DONE),
    # Rule 13: a read reported before this rank published the source (an orphan's
    # leg): done at once; the source goes as soon as it is published (rule 4).
    (P.EMPTY, PI.READ_DONE): (PE.NONE, P.DONE),
    (P.WRITING, PI.WRITE_OK): (PE.NONE, P.DONE),
    (P.WRITING, PI.WRITE_REFUSED): (PE.FAIL, P.EXPIRED),  # rule 5, found as it would start
    (P.WRITING, PI.PLAN_FAILED): (PE.FAIL, P.FAILED),
    (P.WRITING, PI.WRITE_ERROR): (PE.FAIL, P.FAILED),
    (P.WRITING, PI.REGISTER): (PE.STASH, P.SUPERSEDED),  # rule 2: fence old first
    (P.WRITING, PI.CANCEL): (PE.ACK, P.CANCELLING),
    (P.WRITING, PI.PREEMPT): (PE.ACK, P.PREEMPTING),
    (P.SUPERSEDED, PI.WRITE_OK): (PE.WRITE_STASHED, P.WRITING),
    (P.SUPERSEDED, PI.WRITE_ERROR): (PE.FAIL_AND_WRITE_STASHED, P.WRITING),
    (P.SUPERSEDED, PI.REGISTER): (PE.ACK_STASHED_AND_STASH, P.SUPERSEDED),
    (P.SUPERSEDED, PI.CANCEL): (PE.ACK, P.CANCELLING),
    (P.SUPERSEDED, PI.PREEMPT): (PE.ACK, P.PREEMPTING),
    (P.CANCELLING, PI.WRITE_OK): (PE.NONE, P.CANCELLED),
    (P.CANCELLING, PI.WRITE_ERROR): (PE.FAIL, P.CANCELLED),
    (P.CANCELLING, PI.REGISTER): (PE.STASH, P.SUPERSEDED),
    (P.CANCELLING, PI.CANCEL): (PE.ACK, P.CANCELLING),
    (P.CANCELLING, PI.PREEMPT): (PE.ACK, P.CANCELLING),
    (P.PREEMPTING, PI.WRITE_OK): (PE.NONE, P.KV_READY),  # parked for a reissue
    (P.PREEMPTING, PI.WRITE_ERROR): (PE.FAIL, P.KV_READY),
    (P.PREEMPTING, PI.REGISTER): (PE.STASH, P.SUPERSEDED),
    (P.PREEMPTING, PI.CANCEL): (PE.ACK, P.CANCELLING),
    (P.PREEMPTING, PI.PREEMPT): (PE.ACK, P.PREEMPTING),
    **_quiet_when_writing,
    # A stashed registration whose window passes, or whose source is aborted,
    # is failed; the old write carries on, its attempt dropped (the newer
    # registration superseded it): its completion is its fence, and a part of
    # it is answered with its count of parts (rule 9), as after a cancel.
    (P.SUPERSEDED, PI.DEADLINE): (PE.FAIL_STASHED, P.CANCELLING),
    (P.SUPERSEDED, PI.KV_ABORTED): (PE.FAIL_STASHED, P.CANCELLING),
    # Rule 5: the lease ended while an old write is in flight: the stash is
    # answered now, never written later.
    (P.SUPERSEDED, PI.LEASE_EXPIRED): (PE.FAIL_STASHED, P.CANCELLING),
    **_quiet_when_finished,
    # A leg ended before prefill finished stays ended (its cancel or deadline came first).
    (P.CANCELLED, PI.KV_READY): (PE.NONE, P.CANCELLED),
    (P.EXPIRED, PI.KV_READY): (PE.NONE, P.EXPIRED),
    **_ack_when_terminal,
    **_stale,
    **_reopen,
    **_gone,
    # A source that is gone answers every newer registration at once (rule 3).
    (P.GONE, PI.REGISTER): (PE.FAIL_GONE, P.GONE),
    **_ranges,
    **_retarget,
}

_C_TERMINAL = (C.READY, C.CANCELLED, C.FAILED)
CONSUMER_TERMINAL = frozenset(_C_TERMINAL)
_C_FENCING = (C.PREEMPTING, C.CANCELLING, C.FAILING)
#: States waiting for the fence of the current attempt.
CONSUMER_FENCING = frozenset(_C_FENCING)

_fence_inputs = {
    (s, i): (CE.FENCE, s)
    for s in _C_FENCING
    for i in (CI.NOTIFY, CI.CANCEL_ACK, CI.FAIL, CI.PEER_DIED, CI.GRACE)
}

CONSUMER_TABLE: dict[
    tuple[ConsumerState, ConsumerInput], tuple[ConsumerEffect, ConsumerState]
] = {
    # Registrations made before the producer engine is usable wait here; the
    # driver handshakes on Connect (rule 8).
    (C.CONNECTING, CI.CONNECTED): (CE.SEND_HELD, C.REGISTERED),
    (C.CONNECTING, CI.HANDSHAKE_FAILED): (CE.RELEASE_FAILED, C.FAILED),
    (C.CONNECTING, CI.PEER_DIED): (CE.RELEASE_FAILED, C.FAILED),
    (C.CONNECTING, CI.ABORT): (CE.RELEASE_CANCELLED, C.CANCELLED),
    (C.CONNECTING, CI.PREEMPT): (CE.RELEASE, C.PREEMPTED),
    (C.PREEMPTED, CI.REISSUE_CONNECTING): (CE.HOLD, C.CONNECTING),
    (C.REGISTERED, CI.NOTIFY): (CE.COUNT, C.REGISTERED),
    (C.REGISTERED, CI.ALL_NOTIFIED): (CE.READY, C.READY),  # rule 6
    (C.REGISTERED, CI.FAIL): (CE.FAIL_REST, C.FAILING),
    (C.REGISTERED, CI.PEER_DIED): (CE.FAIL_REST, C.FAILING),
    (C.REGISTERED, CI.DEADLINE): (CE.CANCEL_ALL, C.FAILING),
    (C.REGISTERED, CI.ABORT): (CE.CANCEL_ALL, C.CANCELLING),
    (C.REGISTERED, CI.PREEMPT): (CE.PREEMPT_ALL, C.PREEMPTING),
    **_fence_inputs,
    # Its source died with it: no reissue can be written; the fence goes on.
    (C.PREEMPTING, CI.PEER_DIED): (CE.FENCE, C.FAILING),
    (C.PREEMPTING, CI.FENCED): (CE.RELEASE, C.PREEMPTED),  # rule 7
    (C.PREEMPTING, CI.HARD_DEADLINE): (CE.RELEASE, C.PREEMPTED),
    (C.PREEMPTING, CI.REISSUE): (CE.ZOMBIFY_AND_REGISTER, C.REGISTERED),
    (C.PREEMPTING, CI.ABORT): (CE.CANCEL_ALL, C.CANCELLING),
    (C.PREEMPTING, CI.PREEMPT): (CE.NONE, C.PREEMPTING),
    (C.PREEMPTED, CI.REISSUE): (CE.REGISTER, C.REGISTERED),
    (C.PREEMPTED, CI.ABORT): (CE.FINAL_CANCEL_RELEASED, C.CANCELLED),
    (C.PREEMPTED, CI.PREEMPT): (CE.NONE, C.PREEMPTED),
    (C.PREEMPTED, CI.PEER_DIED): (CE.REPORT_FAILED, C.FAILED),  # its source died with it
    (C.CANCELLING, CI.FENCED): (CE.RELEASE_CANCELLED, C.CANCELLED),
    (C.CANCELLING, CI.HARD_DEADLINE): (CE.RELEASE_CANCELLED, C.CANCELLED),
    (C.CANCELLING, CI.ABORT): (CE.NONE, C.CANCELLING),
    (C.CANCELLING, CI.PREEMPT): (CE.NONE, C.CANCELLING),
    (C.FAILING, CI.FENCED): (CE.RELEASE_FAILED, C.FAILED),
    (C.FAILING, CI.HARD_DEADLINE): (CE.RELEASE_FAILED, C.FAILED),
    (C.FAILING, CI.ABORT): (CE.CANCEL_ALL, C.CANCELLING),
    (C.FAILING, CI.PREEMPT): (CE.NONE, C.FAILING),
    # Rule 6: a message of another attempt or use, or a repeat, never counts. A
    # transfer whose old attempts are still fenced (zombies) outlives its end.
    **{(s, CI.STALE): (CE.DROP, s) for s in (C.CONNECTING, C.REGISTERED, *_C_FENCING,
                                             C.PREEMPTED, *_C_TERMINAL)},
    # Rule 9: a part that does not finish its rank only counts; the rank's
    # outcome (NOTIFY, CANCEL_ACK, FAIL) is fed when all its parts are in.
    **{(s, CI.PART): (CE.PART, s) for s in (C.REGISTERED, *_C_FENCING)},
    # Rule 10: a staged write of the registered attempt is scattered before it
    # counts; one that lands while the attempt is being fenced is only a fence.
    # The fence (FENCED) also waits for every scatter still running.
    (C.REGISTERED, CI.STAGED): (CE.SCATTER, C.REGISTERED),
    (C.REGISTERED, CI.SCATTER_DONE): (CE.COUNT, C.REGISTERED),
    (C.REGISTERED, CI.SCATTER_FAILED): (CE.FAIL_REST, C.FAILING),
    # The window bounds the producers' writes, not our own scatters.
    (C.REGISTERED, CI.DEADLINE_SCATTERING): (CE.NONE, C.REGISTERED),
    **{(s, i): (CE.FENCE, s) for s in _C_FENCING
       for i in (CI.STAGED, CI.SCATTER_DONE, CI.SCATTER_FAILED, CI.CHUNK_SCATTERED)},
    **{(s, CI.HARD_DEADLINE_SCATTERING): (CE.FENCE_REMOTE, s) for s in _C_FENCING},
    # A pipelined staged write scatters chunk by chunk (STAGED per chunk); the rank
    # counts only when its last chunk is scattered (SCATTER_DONE).
    (C.REGISTERED, CI.CHUNK_SCATTERED): (CE.NONE, C.REGISTERED),
    # Rule 11: a landing that fails its digest fails the transfer (the rank is
    # fenced once all its parts landed, the others are cancelled); while fencing,
    # it is only a landing.
    (C.REGISTERED, CI.CORRUPT): (CE.FAIL_REST, C.FAILING),
    **{(s, CI.CORRUPT): (CE.FENCE, s) for s in _C_FENCING},
}


Z = ZombieState
#: A zombie attempt: every outcome of a rank fences it; the last fence releases.
ZOMBIE_TABLE: dict[tuple[ZombieState, ConsumerInput], tuple[ConsumerEffect, ZombieState]] = {
    **{(Z.FENCING, i): (CE.FENCE, Z.FENCING)
       for i in (CI.NOTIFY, CI.CANCEL_ACK, CI.FAIL, CI.PEER_DIED, CI.HARD_DEADLINE,
                 CI.STAGED, CI.SCATTER_DONE, CI.SCATTER_FAILED, CI.CHUNK_SCATTERED,
                 CI.GRACE, CI.CORRUPT)},
    (Z.FENCING, CI.STALE): (CE.DROP, Z.FENCING),
    (Z.FENCING, CI.PART): (CE.PART, Z.FENCING),
    (Z.FENCING, CI.FENCED): (CE.RELEASE, Z.RELEASED),
}


def producer_step(
    state: ProducerState, inp: ProducerInput
) -> tuple[ProducerEffect, ProducerState]:
    """Look up a producer leg transition; LocalProtocolError if there is none."""
    try:
        return PRODUCER_TABLE[state, inp]
    except KeyError as exc:
        raise LocalProtocolError(
            "no producer transition", state=state.value, input=inp.value
        ) from exc


def consumer_step(
    state: ConsumerState, inp: ConsumerInput
) -> tuple[ConsumerEffect, ConsumerState]:
    """Look up a consumer transition; LocalProtocolError if there is none."""
    try:
        return CONSUMER_TABLE[state, inp]
    except KeyError as exc:
        raise LocalProtocolError(
            "no consumer transition", state=state.value, input=inp.value
        ) from exc
