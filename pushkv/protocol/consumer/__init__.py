"""The consumer endpoint: one decode rank's side of the protocol.

* :mod:`.endpoint` -- :class:`Consumer`: local input (register, pull, reissue,
  preempt, abort), producer outcomes fed to the transfer table, blocks lent.
* :mod:`.peers` -- the producer engines known to this rank (rule 8's handshake
  on demand): which ranks write into it, which are silent, which are usable.
* :mod:`.requests` -- the messages this rank sends producers (Register, Cancel,
  Skip, Heartbeat) and reads it posts (pull).
* :mod:`.parts` -- counting parts (rule 9) and the blocks a range writes.
* :mod:`.staging` -- packed writes (rule 10): staging lent, chunks scattered.
* :mod:`.view` -- read-only views.
"""

from .endpoint import Consumer

__all__ = ["Consumer"]
