"""The control plane between ranks: a pyzmq side channel, optionally keyed.

* :mod:`.channel` -- :class:`~.channel.SideChannel`: handshake cards and
  control frames between ranks (pyzmq).
* :mod:`.auth` -- the shared key: signing and verifying frames
  (standard library only; also used to sign ``kv_transfer_params``).
"""
