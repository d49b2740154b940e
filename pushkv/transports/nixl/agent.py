"""A thin, typed wrapper around one NIXL agent (``nixl`` 1.5.x Python API).

What it adds to ``nixl._api.nixl_agent``:

* **No idle spinning.** The Python wrapper hard-codes the progress thread's
  delay to 0, so the UCX progress thread busy-spins a core per agent. The
  wrapper builds its C++ agent through ``nixlBind.nixlAgent(name, config)``;
  :func:`_build` substitutes that constructor for the duration of one agent
  construction to set ``pthrDelay`` first.
* **Thread safety.** Agents are created with ``NIXL_THREAD_SYNC_STRICT``: the
  writer thread posts and polls writes while the I/O thread polls
  notifications and loads peers.
* **One backend, with parameters**, chosen by configuration (UCX or LIBFABRIC).
* **Errors as values.** NIXL raises one exception class per status
  (``nixlNotFoundError``, ``nixlRemoteDisconnectError``, ...);
  :func:`nixl_status` names the status so callers can turn it into a protocol
  event.

``nixl`` is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np

from pushkv.protocol.errors import ConfigError

from .config import NixlConfig
from .memory import KVMemory, MemKind

_BUILD_LOCK = threading.Lock()


def load_nixl() -> Any:
    """The ``nixl._api`` module; ImportError with a clear reason if nixl is missing."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl._api as api
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the NIXL transport needs the 'nixl' package (pip install 'pushkv[nixl]'): "
            f"{exc}"
        ) from exc
    return api


def nixl_available() -> bool:
    try:
        load_nixl()
    except ImportError:
        return False
    return True


def nixl_status(exc: BaseException) -> str:
    """The NIXL status an exception stands for (e.g. ``REMOTE_DISCONNECT``), or its type."""
    name = type(exc).__name__
    if name.startswith("nixl") and name.endswith("Error"):
        core = name[len("nixl"):-len("Error")]
        return "".join("_" + c if c.isupper() else c.upper() for c in core).lstrip("_")
    return name


def is_disconnect(exc: BaseException) -> bool:
    return nixl_status(exc) == "REMOTE_DISCONNECT"


def _build(api: Any, name: str, conf: Any, delay_us: int) -> Any:
    bind = api.nixlBind
    with _BUILD_LOCK:
        original = bind.nixlAgent

        def construct(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = delay_us
            return original(agent_name, agent_config)

        bind.nixlAgent = construct
        try:
            return api.nixl_agent(name, conf)
        finally:
            bind.nixlAgent = original


class Agent:
    """One NIXL agent with one backend."""

    def __init__(self, name: str, config: NixlConfig, *, progress_thread: bool = True) -> None:
        api = load_nixl()
        self.name = name
        self.config = config
        if config.progress_thread is not None:
            progress_thread = config.progress_thread
        #: whether NIXL's progress thread runs for this agent
        self.progress_thread = progress_thread
        conf = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._api = api
        self._agent: Any = _build(api, name, conf, config.progress_delay_us)
        if config.backend not in self._agent.get_plugin_list():
            raise ConfigError(
                f"NIXL backend {config.backend} is not available here "
                f"(plugins: {sorted(self._agent.get_plugin_list())})"
            )
        params = dict(config.backend_params)
        if config.num_threads:
            params.setdefault("num_threads", str(config.num_threads))
        self._agent.create_backend(config.backend, params)
        self._registered: Any = None
        self._kind: MemKind = "DRAM"

    # ------------------------------------------------------------- memory

    def register(self, memory: KVMemory) -> None:
        self._kind = memory.kind
        self._registered = self._agent.register_memory(memory.registration(), memory.kind)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    # -------------------------------------------------------------- peers

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Raises on bad metadata."""
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def connect(self, peer: str) -> None:
        self._agent.make_connection(peer)

    def remove_peer(self, peer: str) -> None:
        self._agent.remove_remote_agent(peer)

    # -------------------------------------------------------------- writes

    def prepare_write(self, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes,
                      remote_kind: MemKind) -> Any:
        """A WRITE request from Nx3 ``(addr, len, dev)`` arrays; raises NIXL errors."""
        agent = self._agent
        return agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(local, self._kind),
            agent.get_xfer_descs(remote, remote_kind),
            peer,
            notif,
        )

    def prepare_read(self, local: np.ndarray, remote: np.ndarray, peer: str,
                     remote_kind: MemKind) -> Any:
        """A READ request (``remote`` into ``local``) from Nx3 arrays; raises NIXL errors."""
        agent = self._agent
        return agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, self._kind),
            agent.get_xfer_descs(remote, remote_kind),
            peer,
        )

    def post(self, handle: Any, notif: bytes | None = None) -> str:
        """Start a prepared request: ``DONE``, ``PROC`` or ``ERR``; raises NIXL errors.
        A request that is done may be posted again; ``notif`` replaces its notification."""
        if notif is None:
            return str(self._agent.transfer(handle))
        return str(self._agent.transfer(handle, notif))

    def state(self, handle: Any) -> str:
        return str(self._agent.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        """Release (cancelling if still active) a request; raises if it cannot."""
        self._agent.release_xfer_handle(handle)

    # -------------------------------------------------------- notifications

    def notify(self, peer: str, message: bytes) -> None:
        self._agent.send_notif(peer, message)

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for sender, messages in self._agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((name, bytes(m)) for m in messages)
        return out

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Deregister memory and drop the agent (its progress thread ends with it)."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        if self._registered is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._registered)
            self._registered = None
        del agent
