"""The proxy's view of its upstream instances: health, back-off, outstanding work.

Each :class:`Instance` is *up* (in rotation) or *down*. An instance goes down
when

* ``unhealthy_after`` health probes in a row fail (``GET /health`` refused,
  timed out, or answered with anything but 200; with ``generate_timeout_s``,
  also a one-token completion not answered in time: an engine loop that is
  stuck while its HTTP server still answers), or
* a connection to it is refused or times out (a leg, a discovery), or
* it is refused (:meth:`Pool.refuse`): it answers, but is not what its role
  needs (a decode instance without pushkv's connector as consumer, say).

What happens to one request (an error answer, a connection the instance
accepted and then dropped) does not take an instance out by itself: its
health is the probes' business, or a health check asked right then
(:mod:`.failover`: the instance is found gone).

A down instance is probed again after a back-off that doubles from
``health_interval_s`` up to ``backoff_max_s``; the first probe that succeeds
puts it back in rotation. What the proxy learnt about an instance (side
channel, failure policy) is forgotten when it goes down, and the probe that
brings it back asks again (a restarted instance may have changed). Going
down also wakes every leg still waiting on the instance (:attr:`Instance.down`),
so a hung instance fails its requests over instead of holding them.

An operator may *drain* an instance (:meth:`Pool.drain`): it is given no new
leg while its probes go on, and the legs waiting on it whose answer has not
begun are woken (:attr:`Instance.draining`) to move elsewhere.

:meth:`Pool.pick` chooses the up, undrained instance with the least outstanding work
(prompt tokens for prefill, prompt plus output tokens for decode), ties
broken in rotation. Only the standard library and asyncio are used.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..params import Endpoint

logger = logging.getLogger("pushkv.proxy")


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthSettings:
    """How instances are watched."""

    interval_s: float = 2.0  #: period of the health probes of an up instance
    timeout_s: float = 2.0  #: a probe not answered within this has failed
    unhealthy_after: int = 2  #: failed probes in a row that take an instance down
    backoff_max_s: float = 30.0  #: longest wait between probes of a down instance
    #: Also ask for one generated token (within this many seconds; 0: do not). vLLM's
    #: /health answers while its engine loop is stuck; a token does not.
    generate_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.timeout_s > 0 and self.backoff_max_s > 0):
            raise ValueError("health intervals and timeouts must be positive")
        if self.generate_timeout_s < 0:
            raise ValueError("generate_timeout_s must be >= 0")
        if self.unhealthy_after < 1:
            raise ValueError("unhealthy_after must be at least 1")


@dataclass(eq=False)
class Instance:
    """One upstream vLLM server."""

    url: str
    role: str  #: "prefill" or "decode"
    up: bool = True
    failures: int = 0  #: failed probes in a row
    backoff_s: float = 0.0
    next_probe: float = 0.0
    inflight: int = 0
    work: int = 0  #: outstanding tokens of the legs in flight
    served: int = 0
    endpoint: Endpoint | None = None  #: its pushkv side channel (producers)
    policy: str | None = None  #: decode: its kv_load_failure_policy, once discovered
    #: Its connector was seen to run in the instance's role since it last came up.
    verified: bool = False
    why: str = ""  #: why it is out of rotation (empty while in)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Set (and replaced when the instance comes back) when the instance goes down.
    down: asyncio.Event = field(default_factory=asyncio.Event)
    #: Taken out by an operator (:meth:`Pool.drain`): given no new leg, probed as ever.
    drained: bool = False
    #: Set (and replaced when it is undrained) when the instance is drained.
    draining: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def serving(self) -> bool:
        """In rotation and not drained: it may be given new legs."""
        return self.up and not self.drained

    def forget(self) -> None:
        """Drop what was learnt from the instance; it is asked again on next use."""
        self.endpoint = None
        self.policy = None
        self.verified = False


#: Begins the reason of an instance that is refused (:meth:`Pool.refuse`).
_REFUSED = "refused: "
#: A health probe: True when the instance answered healthy, False when it did not,
#: or why it is refused (it answers, but must not serve: :meth:`Pool.refuse`).
Probe = Callable[[Instance], Awaitable[bool | str]]
#: Told about every change of an instance's state: (instance, up?).
Listener = Callable[[Instance, bool], None]


class Pool:
    """Instances of both roles, their health and their load."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 settings: HealthSettings | None = None) -> None:
        self.settings = settings or HealthSettings()
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self._rr = itertools.count()
        self.listeners: list[Listener] = []

    @property
    def all(self) -> list[Instance]:
        return self.prefill + self.decode

    def of(self, role: str) -> list[Instance]:
        return self.prefill if role == "prefill" else self.decode

    # ----------------------------------------------------------- choosing

    def pick(self, role: str, avoid: Iterable[Instance] = (),
             prefer: Instance | None = None) -> Instance | None:
        """The serving instance of ``role`` (up, not drained) with the least
        outstanding work, preferring ones not in ``avoid``; None when none serves.
        ``prefer``: that instance whenever it serves and is not avoided (a prefill
        instance whose prefix cache holds the prompt)."""
        up = [i for i in self.of(role) if i.serving]
        avoided = set(avoid)
        if prefer is not None and prefer in up and prefer not in avoided:
            return prefer
        fresh = [i for i in up if i not in avoided] or up
        if not fresh:
            return None
        low = min(i.work for i in fresh)
        tied = [i for i in fresh if i.work == low]
        return tied[next(self._rr) % len(tied)]

    def find(self, url: str) -> Instance | None:
        """The instance whose base URL is ``url`` (a trailing slash ignored)."""
        url = url.rstrip("/")
        return next((i for i in self.all if i.url == url), None)

    # ------------------------------------------------------------- drain

    def drain(self, inst: Instance) -> None:
        """Give ``inst`` no new leg; wake the legs waiting on it whose answer has not
        begun (they move to other instances). Probes go on; it stays drained until
        :meth:`undrain`."""
        if not inst.drained:
            inst.drained = True
            inst.draining.set()
            logger.info("%s instance %s is drained", inst.role, inst.url)
            self._tell(inst, inst.up)

    def undrain(self, inst: Instance) -> None:
        """Give ``inst`` legs again (once its probes say it is up)."""
        if inst.drained:
            inst.drained = False
            inst.draining = asyncio.Event()
            logger.info("%s instance %s is no longer drained", inst.role, inst.url)
            self._tell(inst, inst.up)

    # ------------------------------------------------------------ health

    def mark_down(self, inst: Instance, why: str, now: float | None = None) -> None:
        """Take ``inst`` out of rotation; its next probe comes after the back-off."""
        now = time.monotonic() if now is None else now
        s = self.settings
        inst.failures = max(inst.failures, s.unhealthy_after)
        inst.backoff_s = (min(inst.backoff_s * 2, s.backoff_max_s) if inst.backoff_s
                          else s.interval_s)
        inst.next_probe = now + inst.backoff_s
        inst.forget()
        inst.why = why
        if inst.up:
            inst.up = False
            inst.down.set()
            logger.warning("%s instance %s is out of rotation: %s (next probe in %.1f s)",
                           inst.role, inst.url, why, inst.backoff_s)
            self._tell(inst, False)

    def refuse(self, inst: Instance, why: str, now: float | None = None) -> None:
        """Take ``inst`` out of rotation (or keep it out) because it must not serve:
        ``why`` says what is wrong and how to fix it, logged once while it holds."""
        was, up = inst.why, inst.up
        self.mark_down(inst, f"{_REFUSED}{why}", now)
        if not up and was != inst.why:  # mark_down logged it if it was in rotation
            logger.warning("%s instance %s is out of rotation: %s (next probe in %.1f s)",
                           inst.role, inst.url, inst.why, inst.backoff_s)

    def mark_up(self, inst: Instance, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        inst.failures = 0
        inst.backoff_s = 0.0
        inst.next_probe = now + self.settings.interval_s
        if not inst.up:
            inst.up = True
            inst.why = ""
            inst.down = asyncio.Event()
            logger.info("%s instance %s is back in rotation", inst.role, inst.url)
            self._tell(inst, True)

    def probed(self, inst: Instance, ok: bool | str, now: float | None = None) -> None:
        """Account for one health probe's result (a string: why it is refused)."""
        now = time.monotonic() if now is None else now
        if isinstance(ok, str):
            self.refuse(inst, ok, now)
            return
        if ok:
            self.mark_up(inst, now)
            return
        inst.failures += 1
        if not inst.up or inst.failures >= self.settings.unhealthy_after:
            self.mark_down(inst, f"{inst.failures} failed health probe(s)", now)
        else:
            inst.next_probe = now + self.settings.interval_s

    def due(self, now: float) -> list[Instance]:
        return [i for i in self.all if i.next_probe <= now]

    def next_due(self) -> float:
        return min(i.next_probe for i in self.all)

    async def watch(self, probe: Probe) -> None:
        """Probe every instance when due, forever (cancel to stop)."""
        while True:
            now = time.monotonic()
            due = self.due(now)
            if due:
                results = await asyncio.gather(*(probe(i) for i in due))
                done = time.monotonic()
                for inst, ok in zip(due, results, strict=True):
                    self.probed(inst, ok, done)
            await asyncio.sleep(max(0.01, self.next_due() - time.monotonic()))

    def _tell(self, inst: Instance, up: bool) -> None:
        for listener in self.listeners:
            listener(inst, up)
