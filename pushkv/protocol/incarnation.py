"""Incarnations: telling one use of a transfer id from the next.

A transfer is ``(transfer_id, incarnation)``. Whoever creates a transfer (the
router, the simulator's router, a test) draws one incarnation per use of an id
and hands the *same* value to every rank of both engines, as it does the id.
``0`` means "none given": fine for drivers that never reuse an id.

Nothing here reads a clock or the operating system's randomness: the caller
passes the generator (seeded in tests; seeded from ``secrets`` in production).
"""

from __future__ import annotations

import random

#: The incarnation of drivers that give none.
NO_INCARNATION = 0
_SPAN = 1 << 63


def new_incarnation(rng: random.Random) -> int:
    """A fresh incarnation, uniform in ``[1, 2**63)``: two draws collide with
    probability 2**-63, and never equal :data:`NO_INCARNATION`."""
    return rng.randrange(1, _SPAN)
