"""The NIXL transport: real NIXL writes between prefill and decode ranks.

Each rank runs a :class:`~.runtime.api.NixlRuntime`: the protocol endpoint on an
I/O thread, a NIXL agent (UCX by default; LIBFABRIC for EFA), a pyzmq side
channel for handshakes and control messages, and -- on producers -- a
background writer thread that turns transfer plans into NIXL descriptor
arrays, posts the WRITE with its notification and reports completion. The
engine thread only hands commands over a queue and polls events.

Typical use on a decode rank::

    rt = NixlRuntime(info, KVMemory.from_kv(k_caches, v_caches), role="consumer")
    rt.connect("prefill-0", producer_addresses)
    rt.register("req-1", "prefill-0", block_ids, num_tokens)
    ...
    for ev in rt.poll():  # each engine step
        ...               # TransferReady / TransferFailed / ReleaseDestination ...
    rt.close()

and on a prefill rank::

    rt = NixlRuntime(info, KVMemory.from_kv(k_caches, v_caches), role="producer")
    advertise(rt.address)  # the port bound (a free one unless configured)
    rt.prefill_finished("req-1", block_ids, num_tokens)
    for ev in rt.poll():
        ...               # ReleaseSource: the blocks may be freed

The package, from the engine down:

* :mod:`.runtime` -- :class:`NixlRuntime` and its threads: the engine-thread
  API, the I/O loop that owns the endpoint, the handshake, the peer table.
* :mod:`.sidechannel` -- the control plane: pyzmq frames between ranks, keyed.
* the NIXL data path: :mod:`.agent` (one NIXL agent), :mod:`.memory` (the KV
  regions), :mod:`.staging` (packed writes' staging memory and scatter
  thread), :mod:`.poster` with :mod:`.writer` (push) and :mod:`.reader` (pull).
* :mod:`.config` -- :class:`NixlConfig`; :mod:`.testing` -- the conformance
  suite's cluster over real NIXL, in spawned processes.

The names below are loaded on first use, so ``import pushkv.transports.nixl.config``
(as the proxy does) imports neither pyzmq nor NIXL.

See ``docs/nixl.md`` for the design, the thread model and the failure rules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agent import load_nixl, nixl_available
    from .config import NixlConfig
    from .memory import KVMemory
    from .runtime.api import NixlRuntime
    from .runtime.events import CallFailed, Event, PeerLost, RuntimeView, WritesDone
    from .sidechannel.auth import load_key
    from .sidechannel.channel import SideChannelBindError

#: Public name -> the module (relative to this package) that defines it.
_HOMES = {
    "CallFailed": ".runtime.events",
    "Event": ".runtime.events",
    "KVMemory": ".memory",
    "NixlConfig": ".config",
    "NixlRuntime": ".runtime.api",
    "PeerLost": ".runtime.events",
    "RuntimeView": ".runtime.events",
    "SideChannelBindError": ".sidechannel.channel",
    "WritesDone": ".runtime.events",
    "load_key": ".sidechannel.auth",
    "load_nixl": ".agent",
    "nixl_available": ".agent",
}

__all__ = [
    "CallFailed",
    "Event",
    "KVMemory",
    "NixlConfig",
    "NixlRuntime",
    "PeerLost",
    "RuntimeView",
    "SideChannelBindError",
    "WritesDone",
    "load_key",
    "load_nixl",
    "nixl_available",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
