"""The side channel between runtimes: handshakes and control frames over pyzmq.

Every runtime binds one ``PULL`` socket (its advertised address) and opens one
``PUSH`` socket per peer rank it talks to, so a message is a one-way frame and
a reply travels on the replier's own connection. A frame is a two-part zmq
message ``[kind, body]``:

* ``H`` -- a :class:`PeerCard`: who I am (the pushkv ``Hello``), my NIXL agent
  metadata and the addresses of my KV regions. A card with ``reply=False``
  asks for the receiver's card back.
* ``C`` -- one pushkv control frame (``Register``, ``Cancel``, ``Fail``, ...),
  decoded by the protocol's codec on arrival.
* ``B`` -- goodbye: the sender closed; nothing more will come from it (no
  write either: a runtime says goodbye after its writer stopped).
* ``N`` -- nudge (empty body): the sender starts a write to the receiver, whose
  notification will come through NIXL. NIXL cannot wake a waiting thread, and
  its notification needs several polls of the receiver's agent to arrive, so
  the receiver polls fast for a short while. Nothing depends on a nudge: a
  forged or lost one changes how often the receiver polls, never what it does.

Everything received is untrusted: a frame with the wrong shape or an unknown
kind comes back as :data:`GARBAGE` for the caller to count and drop. With a
shared key (:class:`~.auth.SideKey`), every frame carries a third
part, an HMAC tag bound to the destination rank, a per-connection stream and
counter, and a timestamp; frames that fail are dropped here, so they reach no
handler: each is counted (:attr:`SideChannel.auth_dropped`), and the first drop
of each reason is logged (a warning naming the reason and the rank).

Ports: the ``PULL`` socket binds the configured port, or a free (ephemeral)
one when it is 0; :attr:`SideChannel.address` is the address peers must use.
A port that cannot be bound raises :class:`SideChannelBindError`, one line
naming the setting.

Liveness: each ``PUSH`` socket has a zmq monitor. When a peer's process dies
the kernel closes its socket, the connection drops, and reconnection is
refused; :meth:`SideChannel.poll` reports ``("down", address)`` and
``("up", address)`` transitions, and the runtime decides when "down" has
lasted long enough to confirm the peer dead.

The :class:`SideChannel` is owned by one thread (zmq sockets are not
thread-safe); only :meth:`SideChannel.wake` may be called from others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Final

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from pushkv.protocol.errors import ConfigError, DecodeError

from .auth import FAILED, REASONS, SideKey, Signer, Verifier

log = logging.getLogger(__name__)

HELLO: Final = b"H"
CONTROL: Final = b"C"
BYE: Final = b"B"
#: A producer starts a write to the receiver: poll notifications fast for a while.
#: No state depends on it (READY still comes only from the write's notification).
NUDGE: Final = b"N"
#: Integrity (rule 11, pull): a consumer rank's query for the digests of the part of a
#: source it reads, and the producer rank's answer (``pushkv.integrity.envelope``).
SEAL: Final = b"S"
GARBAGE: Final = b"?"
KINDS: Final = (HELLO, CONTROL, BYE, NUDGE, SEAL)

#: Largest side-channel message accepted; larger ones drop the connection.
MAX_MESSAGE: Final = 16 << 20


class PeerCard(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One rank's introduction: identity, NIXL agent and KV memory."""

    hello: bytes  #: a pushkv-encoded Hello frame (RankInfo)
    address: str  #: the sender's side-channel address
    agent_name: str
    agent_metadata: bytes
    bases: tuple[int, ...]  #: region base addresses, in region order
    sizes: tuple[int, ...]  #: region sizes in bytes
    kind: str  #: "DRAM" or "VRAM"
    device: int = 0
    reply: bool = False  #: True when answering a card
    error: str = ""  #: non-empty: the sender refused the handshake
    #: Packed writes: the sender's staging buffer (0: none), same memory kind and device.
    staging_base: int = 0
    staging_size: int = 0


_card_encoder = msgspec.msgpack.Encoder()
_card_decoder = msgspec.msgpack.Decoder(PeerCard)


def encode_card(card: PeerCard) -> bytes:
    return _card_encoder.encode(card)


def decode_card(body: bytes) -> PeerCard:
    """Parse a card from an untrusted peer; DecodeError (only) if malformed."""
    try:
        card = _card_decoder.decode(body)
    except (msgspec.MsgspecError, ValueError, TypeError, OverflowError) as exc:
        raise DecodeError(f"malformed handshake card: {exc}") from exc
    if card.kind not in ("DRAM", "VRAM") or len(card.bases) != len(card.sizes):
        raise DecodeError("handshake card has a bad memory description")
    return card


class SideChannelBindError(ConfigError):
    """The side channel cannot bind its configured address (port taken, host not local)."""

    def __init__(self, host: str, port: int, setting: str, why: str) -> None:
        hint = "; 0 picks a free port" if setting == "port" else ""
        super().__init__(f"side channel cannot bind tcp://{host}:{port}: {why} "
                         f"(setting: {setting}{hint})")
        self.host, self.port, self.setting = host, port, setting


def replace_card(card: PeerCard, **changes: object) -> PeerCard:
    """A copy of ``card`` with some fields changed."""
    return msgspec.structs.replace(card, **changes)


@dataclass(slots=True)
class _Out:
    socket: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    signer: Signer | None


_UP = zmq.EVENT_CONNECTED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class SideChannel:
    """One rank's side-channel sockets."""

    def __init__(self, host: str, port: int = 0, *, advertise_host: str | None = None,
                 key: SideKey | None = None, me: str = "") -> None:
        """Bind ``host:port`` (0: a free port). ``advertise_host``: the host peers
        use (default ``host``). ``key``: authenticate every frame; ``me`` is this
        rank's identity (``engine_id/rank``), which frames sent to it are bound to."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        try:
            self._pull.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as exc:
            self._pull.close()
            self._ctx.term()
            setting = "port" if exc.errno == zmq.EADDRINUSE else "host"
            why = (exc.strerror or str(exc)).split(" (addr=")[0].lower()
            raise SideChannelBindError(host, port, setting, why) from None
        bound = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        #: The bound port (the configured one, or the free one picked).
        self.port: int = int(bound.rsplit(":", 1)[1])
        #: The address peers must use to reach this rank.
        self.address: str = (f"tcp://{advertise_host}:{self.port}" if advertise_host
                             else bound)
        self._key = key
        self._verifier: Verifier | None = key.verifier(me) if key is not None else None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._out: dict[str, _Out] = {}
        self._by_monitor: dict[zmq.Socket[bytes], str] = {}
        self.dropped = 0  #: frames not sent (peer queue full or unknown)
        self._me = me
        self._noted: set[str] = set()  # drop reasons already logged

    # ------------------------------------------------------------ any thread

    def wake(self) -> None:
        """Interrupt :meth:`poll` (safe from any thread)."""
        with contextlib.suppress(OSError):  # full: already signalled; closed: closing
            os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------ owner only

    @property
    def auth_dropped(self) -> dict[str, int]:
        """Frames dropped by authentication, by reason (empty without a key)."""
        return dict(self._verifier.dropped) if self._verifier is not None else {}

    def open(self, address: str, dest: str) -> None:
        """Start connecting to a peer rank whose identity is ``dest`` (``engine_id/rank``).

        Idempotent; a new ``dest`` for an open address re-keys its frames."""
        out = self._out.get(address)
        if out is not None:
            if self._key is not None and out.signer is not None and out.signer.dest != dest:
                out.signer = self._key.signer(dest)
            return
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(_UP | _DOWN)
        sock.connect(address)
        self._out[address] = _Out(sock, monitor,
                                  self._key.signer(dest) if self._key is not None else None)
        self._by_monitor[monitor] = address
        self._poller.register(monitor, zmq.POLLIN)

    def send(self, address: str, kind: bytes, body: bytes) -> bool:
        """Queue a frame for a peer; False if it cannot be queued."""
        out = self._out.get(address)
        if out is None:
            self.dropped += 1
            self._note("unsent", f"no connection to {address}")
            return False
        parts: tuple[bytes, ...] = (kind, body)
        if out.signer is not None:
            parts = (kind, body, out.signer.sign(kind, body))
        try:
            out.socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=len(body) < 65536)
        except zmq.ZMQError as exc:
            self.dropped += 1
            self._note("unsent", f"cannot queue a frame for {address}: {exc.strerror or exc}")
            return False
        return True

    def _note(self, reason: str, detail: str) -> None:
        """Log the first dropped frame of each reason (every one is counted)."""
        if reason in self._noted:
            return
        self._noted.add(reason)
        log.warning("pushkv side channel %s of %s: dropped a frame (%s): %s; counted, and "
                    "further drops of this kind are not logged", self.address,
                    self._me or "this rank", reason, detail)

    def forget(self, address: str) -> None:
        """Close the connection to a peer."""
        out = self._out.pop(address, None)
        if out is not None:
            self._close_out(out)

    def _close_out(self, out: _Out, linger_ms: int = 0) -> None:
        self._by_monitor.pop(out.monitor, None)
        self._poller.unregister(out.monitor)
        with contextlib.suppress(zmq.ZMQError):
            out.socket.disable_monitor()
        out.monitor.close(0)
        out.socket.close(linger_ms)

    def poll(self, timeout_s: float) -> tuple[list[tuple[bytes, bytes]], list[tuple[str, str]]]:
        """Wait up to ``timeout_s`` for traffic.

        Returns ``(frames, links)``: frames as ``(kind, body)`` (kind
        :data:`GARBAGE` for anything malformed, body then the raw bytes), and
        link transitions as ``("up" | "down", address)``.
        """
        frames: list[tuple[bytes, bytes]] = []
        links: list[tuple[str, str]] = []
        if 0 < timeout_s < 0.001:  # zmq waits whole milliseconds: look, nap, look again
            ready = dict(self._poller.poll(0))
            if not ready:
                time.sleep(timeout_s)
                ready = dict(self._poller.poll(0))
        else:
            ready = dict(self._poller.poll(max(0, int(timeout_s * 1000 + 0.999))))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if self._pull in ready:
            for _ in range(10_000):
                try:
                    parts = self._pull.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                verifier = self._verifier
                if verifier is not None:  # authenticated: drop (and count) what fails
                    ok = (verifier.check(parts[0], parts[1], parts[2]) if len(parts) == 3
                          else verifier.drop(FAILED))
                    if not ok:
                        self._note(verifier.last_drop, REASONS[verifier.last_drop])
                    elif parts[0] in KINDS:
                        frames.append((parts[0], parts[1]))
                    else:  # authentic but unknown: the peer's bug, not an attack
                        frames.append((GARBAGE, parts[1][:1024]))
                elif len(parts) == 2 and parts[0] in KINDS:
                    frames.append((parts[0], parts[1]))
                else:
                    frames.append((GARBAGE, b"".join(parts)[:1024]))
        for monitor, address in list(self._by_monitor.items()):
            if monitor not in ready:
                continue
            while True:
                try:
                    raw = monitor.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = parse_monitor_message(raw)["event"]
                links.append(("up" if event & _UP else "down", address))
        return frames, links

    def close(self, linger_s: float = 0.2) -> None:
        """Flush pending frames for up to ``linger_s``, then close everything."""
        for out in list(self._out.values()):
            self._close_out(out, int(linger_s * 1000))
        self._out.clear()
        self._poller.unregister(self._pull)
        self._pull.close(0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
