"""One rank's runtime: the threads that drive a protocol endpoint over NIXL.

* :mod:`.api` -- :class:`~.api.NixlRuntime`, what the engine thread calls;
  each call queues a command (:mod:`.commands`) and never blocks.
* :mod:`.loop` -- :class:`~.loop.IOLoop`, the I/O thread: the only one that
  touches the endpoint, the side channel and the peer table.
* :mod:`.cards` -- the loop's half that meets peers: the card exchange and
  liveness, following the table of :mod:`.handshake`.
* :mod:`.peers` -- the peer table: who the peers are, where, whether alive.
* :mod:`.events` -- what the runtime reports back to the engine thread.

Below this package: the NIXL data path of :mod:`pushkv.transports.nixl`
(agent, memory, staging, writer, reader) and the control plane of
:mod:`pushkv.transports.nixl.sidechannel`. The public names are re-exported by
:mod:`pushkv.transports.nixl`.
"""
