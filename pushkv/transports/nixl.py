"""The NIXL transport: real NIXL writes between prefill and decode ranks.

Each rank runs a :class:`~.runtime.NixlRuntime`: the protocol endpoint on an
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

See ``docs/nixl.md`` for the design, the thread model and the failure rules.
"""

from __future__ import annotations

from .nixl_agent import load_nixl, nixl_available
from .nixl_config import NixlConfig
from .nixl_memory import KVMemory
from .runtime import NixlRuntime
from .runtime_events import CallFailed, Event, PeerLost, RuntimeView, WritesDone
from .sidechannel import SideChannelBindError
from .sidechannel_auth import load_key

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
