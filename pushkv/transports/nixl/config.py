"""Settings of the NIXL transport, one typed dataclass with a help string per field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pushkv.integrity import Injector, IntegrityConfig
from pushkv.protocol.errors import ConfigError

Backend = Literal["UCX", "LIBFABRIC"]
ControlChannel = Literal["side", "nixl"]


@dataclass(frozen=True, kw_only=True)
class NixlConfig:
    """How one rank's runtime talks to its peers.

    Protocol timeouts (lease, window, fence grace, heartbeat, handshake timeout)
    are not here: they are the endpoint's, in :mod:`pushkv.protocol.config`."""

    backend: Backend = field(
        default="UCX",
        metadata={"help": "NIXL backend: UCX (host memory, CUDA memory on GPUs) or "
                  "LIBFABRIC (EFA)"},
    )
    backend_params: dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "extra backend init parameters, passed to create_backend"},
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "interface the side channel binds to (0.0.0.0: all; then set "
                  "advertise_host)"},
    )
    port: int = field(
        default=0,
        metadata={"help": "side-channel TCP port; 0 (default) binds a free one. A configured "
                  "port that is taken fails at start-up"},
    )
    advertise_host: str | None = field(
        default=None,
        metadata={"help": "host peers use to reach the side channel (None: host)"},
    )
    key_file: str = field(
        default="",
        metadata={"help": "file holding the shared side-channel key (at least 16 bytes, "
                  "surrounding whitespace stripped); set, every side-channel frame is "
                  "authenticated"},
    )
    key_env: str = field(
        default="PUSHKV_SIDE_CHANNEL_KEY",
        metadata={"help": "environment variable holding the key, read when key_file is "
                  "empty; unset or empty: no key (frames are not authenticated)"},
    )
    key_window_s: float = field(
        default=60.0,
        metadata={"help": "with a key: how far a frame's timestamp may be from the "
                  "receiver's clock (clock skew plus transit); older frames are dropped"},
    )
    progress_thread: bool | None = field(
        default=None,
        metadata={"help": "run NIXL's progress thread, sleeping progress_delay_us between "
                  "polls. None: off for host memory (the writer thread drives progress while "
                  "it writes, the I/O thread's notification poll while transfers are live; "
                  "a progress thread waking every few hundred microseconds halves the "
                  "throughput of a large host-memory write and takes time from every engine "
                  "step on its core), on for consumers of device memory"},
    )
    progress_delay_us: int = field(
        default=1000,
        metadata={"help": "sleep of the NIXL progress thread between polls (0 = busy spin: "
                  "a whole core per agent)"},
    )
    num_threads: int = field(
        default=0, metadata={"help": "backend worker threads (0: backend default)"}
    )
    active_poll_s: float = field(
        default=0.001,
        metadata={"help": "notification poll period while transfers are live"},
    )
    idle_poll_s: float = field(
        default=0.02,
        metadata={"help": "notification poll period while nothing is live"},
    )
    write_poll_s: float = field(
        default=0.0002,
        metadata={"help": "writer thread: sleep between completion checks of a posted write"},
    )
    nudge_poll_s: float = field(
        default=0.0001,
        metadata={"help": "notification poll period after a producer's nudge (a side-channel "
                  "frame sent as it starts a write to this consumer), for nudge_window_s "
                  "or until that write's notification came"},
    )
    nudge_window_s: float = field(
        default=0.01,
        metadata={"help": "how long a nudge keeps the fast notification poll (0: a producer "
                  "sends no nudge and a consumer ignores them)"},
    )
    write_timeout_s: float = field(
        default=60.0,
        metadata={"help": "a posted write still running after this is cancelled and failed"},
    )
    peer_confirm_s: float = field(
        default=1.0,
        metadata={"help": "a peer whose side channel dropped and stays unreachable this "
                  "long is confirmed dead"},
    )
    control_channel: ControlChannel = field(
        default="side",
        metadata={"help": "where control messages (Register, Cancel, ...) are sent: the "
                  "side channel, or NIXL notifications; both are always accepted"},
    )
    close_timeout_s: float = field(
        default=10.0,
        metadata={"help": "close(): how long to wait for writes in flight"},
    )
    integrity: str = field(
        default="off",
        metadata={"help": "digests of written ranges (rule 11): off, on, sample or sample:N "
                  "(one transfer in N); a producer seals its notifications with the digest "
                  "of the source bytes, a consumer checks its landed bytes against it and "
                  "fails a mismatch with CORRUPT. Off: the wire bytes are the plain frames"},
    )
    seal_wait_s: float = field(
        default=2.0,
        metadata={"help": "pull with integrity: how long a finished read of part of a "
                  "source (a cached prefix's remainder, a layer subset) waits for its "
                  "producer rank's digests of exactly that part, asked for as the read "
                  "was posted; none by then fails the read (CORRUPT, unverified)"},
    )
    inject: str = field(
        default="",
        metadata={"help": "tests and the chaos benchmark only: corrupt landed writes on a "
                  "consumer before they are checked, 'kind[,kind...][:N]' (flip, neighbour, "
                  "stale, zero; one write in N); empty: never"},
    )

    def __post_init__(self) -> None:
        IntegrityConfig.parse(self.integrity)  # ConfigError now, not at the first write
        if self.inject:
            Injector.parse(self.inject)
        if self.backend not in ("UCX", "LIBFABRIC"):
            raise ConfigError(f"backend must be UCX or LIBFABRIC, not {self.backend!r}")
        if self.control_channel not in ("side", "nixl"):
            raise ConfigError(f"control_channel must be side or nixl, not "
                              f"{self.control_channel!r}")
        if self.host in ("0.0.0.0", "*", "::", "") and not self.advertise_host:
            raise ConfigError(f"host {self.host!r} binds every interface: set advertise_host "
                              "to the address peers use")
        if self.progress_delay_us < 0 or self.num_threads < 0 or not 0 <= self.port < 65536:
            raise ConfigError("progress_delay_us, num_threads and port must be >= 0")
        if self.nudge_window_s < 0:
            raise ConfigError(f"nudge_window_s must be >= 0, got {self.nudge_window_s}")
        for name in ("active_poll_s", "idle_poll_s", "write_poll_s", "nudge_poll_s",
                     "write_timeout_s", "peer_confirm_s", "close_timeout_s", "key_window_s",
                     "seal_wait_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
