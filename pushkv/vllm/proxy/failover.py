"""What ``pushkv proxy`` does when a leg's instance fails: the failover policies.

Two stages, each with its own rule:

* **Before the answer began** (no byte of it reached the client; a non-streamed
  completion answered from a streamed decode leg (:mod:`.assemble`): the decode
  instance produced no token of it yet; any other non-streamed request: its
  whole answer has not come): the policy named by ``failover`` decides.

  - ``retry`` (the default): the request is sent again as a **new transfer**
    (new transfer id and incarnation; both legs, on other instances when there
    are), at most ``retries`` times. The prefill side computes the prompt again
    (its prefix cache may serve the prompt's full blocks).
  - ``retarget``: the **same decode leg** -- the same transfer id and
    incarnation, at the next turn (``pushkv_target``: protocol rule 12) -- goes
    to another decode instance while the prefill leg goes on; the producer
    writes its held source to the new consumer, fails the old one's legs (their
    blocks are fenced as on any failure), and the prompt is computed once. With
    ``retarget_hold_s`` > 0 on the prefill instances that holds too when the
    first decode instance had its whole KV but took no decode step of it yet
    (its ranks report the first step, ``Consumed``; the cost: the prefill's
    blocks are held about one decode step plus a side-channel trip longer,
    at most ``retarget_hold_s``). A source already released (the hold is 0 or
    ran out, or the first decode instance took its first step and was lost
    before its first token came) fails the new leg: the new decode instance's
    ``kv_load_failure_policy`` decides there (``recompute``: it computes the
    prompt itself and answers; ``fail``: it answers an error). An error from a
    re-targeted leg whose instance stays healthy is taken for that (the
    engine's 500 does not say why), and the request goes once more, as a
    **new transfer**, to the same prefill instance (:class:`Reissue`): its
    prefix cache serves the prompt's full blocks, so it computes the last
    partial block again (a whole block when the prompt fills its blocks:
    vLLM computes at least one token). A poison request cannot get here
    without its first decode instance being found gone, and the reissue is
    never repeated.

* **Mid-stream** (a streamed completion whose client holds k tokens, or an
  assembled non-streamed one whose decode leg produced k >= 1): the answer is
  **resumed** on another decode instance, at most ``resumes`` times
  (:mod:`.resume`).

Which failures fail over at all (:meth:`Failover.cause`): a leg that no engine
accepted (refused, timed out, its instance left rotation or was drained while
the leg waited) always may. A leg an engine accepted and then failed (a 5xx, a
dropped connection, a stream cut short) may only when the instance is then found
gone: its ``/health`` does not answer 200 within the probe timeout (a process
killed, stopped or shutting down). An instance that is still healthy failed on
this request alone, which may be a poison request that would make the next
engine fail too: the client gets the error. A request that crashes whole
engines is therefore sent to at most ``retries`` + ``resumes`` more instances.

Failovers are counted by stage, role and cause
(``pushkv_proxy_failover_causes_total``), with the prompt tokens they send to a
prefill instance again (``pushkv_proxy_failover_prompt_tokens_total``).
"""

from __future__ import annotations

import logging

import aiohttp

from .legs import GONE, LegError
from .metrics import ProxyMetrics
from .pool import Instance, Pool

logger = logging.getLogger("pushkv.proxy")

#: The ``cause`` of a reissue (:class:`Reissue`): the re-targeted leg found no source.
SOURCE_RELEASED = "source_released"
RETRY = "retry"
RETARGET = "retarget"
#: The policies ``failover`` may name.
POLICIES = (RETRY, RETARGET)
#: Stages of a failover (the ``stage`` label of the failover metrics).
BEFORE_ANSWER = "before_answer"
MID_STREAM = "mid_stream"

def check_policy(name: str) -> str:
    """``name`` if it is a failover policy; ValueError saying why not."""
    if name not in POLICIES:
        raise ValueError(f"failover policy {name!r} is not one of {', '.join(POLICIES)}")
    return name


class Reissue(Exception):
    """A re-targeted decode leg failed while its instance stays healthy: the
    producer had released the source (the first decode instance had it all and
    its hold, if any, ended: see the module docs). The
    request goes once more as a new transfer, to ``prefill`` (its prefix cache holds
    the prompt's full blocks), avoiding the decode instances in ``lost``."""

    def __init__(self, exc: LegError, prefill: Instance, lost: list[Instance]) -> None:
        super().__init__(exc.message)
        self.exc, self.prefill, self.lost = exc, prefill, lost


class Failover:
    """Decides whether a failed leg fails over, and counts what failovers cost."""

    def __init__(self, policy: str, pool: Pool, metrics: ProxyMetrics,
                 probe_timeout_s: float) -> None:
        self.policy = check_policy(policy)
        self.pool = pool
        self.metrics = metrics
        self.probe_timeout_s = probe_timeout_s

    async def cause(self, exc: LegError, inst: Instance,
                    session: aiohttp.ClientSession) -> str:
        """Why the leg ``exc`` may be served elsewhere, or '' when it must not be."""
        if exc.cause:
            return exc.cause
        if exc.dropped and await self.gone(inst, session):
            self.pool.mark_down(inst, f"it broke a leg off and its /health then failed "
                                f"({exc.what:.200})")
            return GONE
        return ""

    @staticmethod
    def gone_error(exc: LegError, inst: Instance) -> LegError:
        """The error a client gets when no other instance took over from ``inst``,
        found gone after it broke ``exc``'s leg off."""
        return LegError(exc.leg, 502, f"{inst.role} instance {inst.url} went away while "
                        f"serving this request ({exc.what})", cause=GONE, instance=inst.url)

    async def gone(self, inst: Instance, session: aiohttp.ClientSession) -> bool:
        """Whether ``inst`` fails a health check now (refused, no 200 in time)."""
        if not inst.up:
            return True
        try:
            async with session.get(inst.url + "/health", timeout=aiohttp.ClientTimeout(
                    total=self.probe_timeout_s)) as resp:
                return resp.status != 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return True

    def retargets(self, exc: LegError, answer_began: bool) -> bool:
        """Whether a decode leg that failed before the answer began goes, unchanged, to
        another decode instance (``retarget``) rather than a new transfer."""
        return self.policy == RETARGET and exc.leg == "decode" and not answer_began

    async def released(self, exc: LegError, inst: Instance, answer_began: bool,
                       session: aiohttp.ClientSession) -> bool:
        """Whether a re-targeted decode leg that failed at ``inst`` met a released
        source: the engine failed it (an error answer or a dropped leg) before the
        answer began, and ``inst`` stays healthy."""
        return (self.policy == RETARGET and exc.leg == "decode" and exc.dropped
                and not answer_began and not await self.gone(inst, session))

    def record(self, stage: str, exc: LegError, cause: str, prompt_tokens: int) -> None:
        """Count one failover and the prompt tokens it sends to a prefill instance."""
        self.metrics.failover_causes.labels(stage, exc.leg, cause).inc()
        self.metrics.failover_prompt_tokens.labels(stage).inc(prompt_tokens)
        logger.info("%s failover (%s leg, %s): %s", stage, exc.leg, cause, exc.message)
