"""A conformance suite every pushkv transport runs against itself.

A transport provides a :class:`Cluster` -- one producer engine and one
consumer engine of a given :class:`Topology`, with source memory filled with
seeded random bytes and destination memory zeroed -- and calls
:func:`run_conformance` (or each ``check_*`` on its own, e.g. one pytest test
per check). Every check drives real transfers and compares the **bytes** that
landed against a per-token reference computed here, independently of the
planner: the whole destination memory must equal the reference, so a byte
written anywhere it should not be fails the check too.

The in-memory transport runs these in simulated time; a real transport runs
them in wall-clock time across processes, so every wait has a timeout and
configurations keep deadlines short. Where a check needs one event to happen
before another (the registration before the prefill's end, or after it), it
waits until the cluster shows the first one -- the producer took the
registration in (:attr:`Snapshot.registrations`), holds the source
(:attr:`Snapshot.held`) -- never for a fixed time, so the order tested holds
on any transport at any speed.

The modules: :mod:`.cluster` (the :class:`Cluster` a transport provides, its
:class:`Topology` and :class:`Snapshot`, the byte reference and the conditions the
checks wait on), :mod:`.push` (:data:`CHECKS`, :data:`REUSED_ID_CHECKS`,
:func:`run_conformance`), :mod:`.pull` (:data:`PULL_CHECKS`, opt-in) and
:mod:`.progressive` (:data:`PROGRESSIVE_CHECKS`, opt-in). Every name is importable
from this package.
"""

from .cluster import (
    Cluster,
    MakeCluster,
    Snapshot,
    Topology,
    assert_clean,
    assert_destination,
    reference_destination,
    registered,
    source_held,
)
from .progressive import (
    PROGRESSIVE_CHECKS,
    check_progressive,
    check_progressive_aborted,
    check_progressive_cancel,
    check_progressive_reissue,
    chunks,
    layerwise,
)
from .pull import (
    PULL_CHECKS,
    check_pull_bad_source,
    check_pull_cancel,
    check_pull_garbage,
    check_pull_lease,
    check_pull_past_the_lease,
    check_pull_producer_killed,
    check_pull_reused_id,
    check_pull_transfer,
)
from .push import (
    CHECKS,
    REUSED_ID_CHECKS,
    TOPOLOGIES,
    check_cancel,
    check_either_order,
    check_garbage,
    check_out_of_range_registration,
    check_prefill_aborted,
    check_producer_killed,
    check_reissue,
    check_reissue_after_kv,
    check_reused_id,
    check_transfer,
    run_conformance,
)

__all__ = [
    "CHECKS", "PROGRESSIVE_CHECKS", "PULL_CHECKS", "REUSED_ID_CHECKS", "TOPOLOGIES",
    "Cluster", "MakeCluster", "Snapshot", "Topology", "assert_clean", "assert_destination",
    "check_cancel", "check_either_order", "check_garbage", "check_out_of_range_registration",
    "check_prefill_aborted", "check_producer_killed", "check_progressive",
    "check_progressive_aborted", "check_progressive_cancel", "check_progressive_reissue",
    "check_pull_bad_source", "check_pull_cancel", "check_pull_garbage", "check_pull_lease",
    "check_pull_past_the_lease", "check_pull_producer_killed", "check_pull_reused_id",
    "check_pull_transfer", "check_reissue", "check_reissue_after_kv", "check_reused_id",
    "check_transfer", "chunks", "layerwise", "reference_destination", "registered",
    "run_conformance", "source_held",
]
