"""One error hierarchy for the whole protocol.

Two families, as in every sans-IO protocol library:

* :class:`LocalProtocolError` -- the *local* caller misused an endpoint (asked
  for something impossible in the current state, passed a bad configuration).
  It is raised, and the endpoint's state is unchanged.
* :class:`RemoteProtocolError` -- a *peer* sent something wrong (malformed
  bytes, an out-of-range block id, an unknown engine). It never escapes
  ``receive``: the endpoint turns it into a :class:`~pushkv.protocol.events.Rejected`
  output and counts it. The decoder raises :class:`DecodeError`, a subclass.

Every error carries the structured fields needed to debug a failing
interleaving: transfer id, attempt, state and input where they apply.
"""

from __future__ import annotations


class PushKVError(Exception):
    """Base class of every error pushkv raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        transfer_id: str | None = None,
        attempt: int | None = None,
        state: str | None = None,
        input: str | None = None,
        incarnation: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.transfer_id = transfer_id
        self.incarnation = incarnation
        self.attempt = attempt
        self.state = state
        self.input = input

    def __str__(self) -> str:
        ctx = [
            f"{k}={v!r}"
            for k, v in (
                ("transfer_id", self.transfer_id),
                ("incarnation", self.incarnation),
                ("attempt", self.attempt),
                ("state", self.state),
                ("input", self.input),
            )
            if v is not None
        ]
        return f"{self.message} ({', '.join(ctx)})" if ctx else self.message


class LocalProtocolError(PushKVError):
    """The local caller asked for something the protocol does not allow."""


class ConfigError(LocalProtocolError, ValueError):
    """A configuration, layout or mapping parameter is invalid."""


class PlanError(LocalProtocolError, ValueError):
    """A transfer cannot be planned (layouts incompatible, blocks missing)."""


class RemoteProtocolError(PushKVError):
    """A peer violated the protocol. Never raised out of an endpoint."""


class DecodeError(RemoteProtocolError):
    """Bytes from the wire are not a valid pushkv message."""


class ValidationError(RemoteProtocolError):
    """A well-formed message asks for something out of range for its sender."""
