"""The producer endpoint: one prefill rank's side of the protocol.

* :mod:`.endpoint` -- :class:`Producer`: local input (prefill, ranges, writes
  completing), the leg and source tables driven, writes planned and posted.
* :mod:`.targets` -- the consumer ranks this rank writes into (handshakes).
* :mod:`.answers` -- what each peer message becomes as table inputs (rule 2's
  stale filtering, rule 3's reopen, tombstones answering late messages).
* :mod:`.staging` -- packed writes (rule 10): gathering through this rank's staging.
* :mod:`.view` -- read-only views and the answers built from a leg's history.
"""

from .endpoint import Producer

__all__ = ["Producer"]
