"""A deterministic in-process transport with real byte buffers.

:class:`InMemoryNetwork` holds producer and consumer ranks in one process, each
with its KV memory as numpy byte arrays (one per region). It moves control
frames (really encoded and decoded), executes writes and reads by copying
bytes according to the plan, and delivers write notifications -- in simulated
time, in a deterministic order, and on command out of order: tests can
deliver any pending item next, duplicate or drop a message, fail a write, or
kill an engine. With a :class:`~pushkv.protocol.packing.PackingConfig` every
rank has staging memory and the endpoints pack writes (rule 10): a packed
write is gathered into the producer rank's staging when issued, copied in
wire chunks into the staging range its registration lent when it lands, and
scattered into the destination blocks by the consumer's ``Scatter`` -- an
item of its own, which tests may deliver late, fail or reorder like a write.

Delivery
--------

``delivery="adversarial"`` (the default) is no kinder than what NIXL states,
driven by a ``random.Random(seed)`` the network owns (no wall clock, no global
random: the same seed gives the same run):

* a posted write's bytes become visible at the destination in *pieces* (its
  plan cut into a few sub-plans by region pairs and runs; a packed write's
  staging image cut into byte ranges, per pipelined chunk), each landing at a
  time of its own after the write was posted -- a ``"piece"`` item -- and at
  the latest when the write's notification (a chunk's: its chunk's pieces) is
  delivered: delivering a notification, even by hand, first lands what is left;
* the producer's local completion (the ``"done"`` item that calls
  ``write_completed(ok=True)``) is decoupled from visibility: it is often
  delivered while pieces are still on the wire, and so are the side-channel
  frames the producer sends after it (CancelAck, Fail, ...): they overtake
  the bytes. A piece that lands after the local completion carries the source
  bytes as they were at that completion (the NIC has read them by then);
* a write that fails (dropped by a test with :meth:`InMemoryNetwork.drop`, or
  its destination dead when it completes) sends no notification, but each of
  its pieces still on the wire may land (about half do), at a time drawn up to
  the write's *max in-flight time* after it was posted (``max_inflight_s``;
  default: the destination consumer's ``ConsumerConfig.fence_grace_s``), so
  possibly well after the producer saw the failure. A killed producer's writes
  may likewise land pieces, within the same bound, even after its death is
  known (the consumer fences a dead producer only once its fence grace passed);
* a read (pull, ``IssueRead``) takes its pieces from the source at times
  between its post and its completion (what is left at the completion); a
  read completes whatever the producer did meanwhile, so a source released
  before the read completed hands the consumer whatever is in those blocks;
* control frames still take ``latency`` each, in the order sent.

``delivery="eager"`` is the earlier, kinder model: a write's bytes all land at
once when it completes, together with its notification and its completion,
and a read whose source is no longer held fails.

In both modes tests drive items by hand as before (``hold=True``,
:meth:`~InMemoryNetwork.deliver`, :meth:`~InMemoryNetwork.drop`, ...); in
adversarial mode pieces are items too (never dropped: a piece lands or is
discarded with its failed write), bounded by their write's max in-flight time.

Checks
------

The transport *checks* as it goes: every write's bytes (every piece) that land
record a violation if they hit a destination block that the consumer does not
hold lent to that transfer and attempt (invariants 2 and 3) -- for a packed
write, also a staging range not lent to it; a piece of a read records one if
it takes bytes from a source block the producer no longer holds for that
transfer (released); a write still reading a released source records one; and
so does a source block released twice (invariant 6).
"""

from .cluster import InMemoryCluster, pair
from .flights import DELIVERIES, Flight, Item, Piece
from .memory import copy_plan, read_ahead, region_memory, touched_blocks
from .network import InMemoryNetwork
from .nodes import ConsumerNode, Node, ProducerNode, Wire

__all__ = [
    "DELIVERIES", "ConsumerNode", "Flight", "InMemoryCluster", "InMemoryNetwork", "Item", "Node",
    "Piece", "ProducerNode", "Wire", "copy_plan", "pair", "read_ahead", "region_memory",
    "touched_blocks",
]
