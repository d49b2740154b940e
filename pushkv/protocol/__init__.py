"""The sans-IO protocol core: messages, state machines, mapping and planning.

Nothing here reads a clock, starts a thread or does I/O; it needs only the
standard library, numpy and msgspec.
"""

from .config import ConsumerConfig, ProducerConfig
from .consumer import Consumer
from .errors import (
    ConfigError,
    DecodeError,
    LocalProtocolError,
    PlanError,
    PushKVError,
    RemoteProtocolError,
    ValidationError,
)
from .events import (
    Action,
    Connect,
    FailurePolicy,
    IssueRead,
    IssueWrite,
    Mode,
    PackedWrite,
    Peer,
    Publish,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    ReleaseStaging,
    Scatter,
    SendMessage,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)
from .incarnation import NO_INCARNATION, new_incarnation
from .layout import EngineSpec, KVLayout, RankInfo, uniform_ranks
from .mapping import Assignment, assignment, expected_writers, targets_of, writers_of
from .messages import (
    Cancel,
    CancelAck,
    Consumed,
    Fail,
    FailReason,
    Heartbeat,
    Hello,
    Message,
    Notify,
    ReadDone,
    Register,
    Skip,
    decode,
    encode,
)
from .packing import PackedPlan, PackingConfig
from .planner import TransferPlan, coalesce, plan_transfer
from .producer import Producer
from .states import ConsumerState, ProducerState

__all__ = [
    "NO_INCARNATION",
    "Action",
    "Assignment",
    "Cancel",
    "CancelAck",
    "Consumed",
    "ConfigError",
    "Connect",
    "Consumer",
    "ConsumerConfig",
    "ConsumerState",
    "DecodeError",
    "EngineSpec",
    "Fail",
    "FailReason",
    "FailurePolicy",
    "Heartbeat",
    "Hello",
    "IssueRead",
    "IssueWrite",
    "KVLayout",
    "LocalProtocolError",
    "Message",
    "Mode",
    "Notify",
    "PackedPlan",
    "PackedWrite",
    "PackingConfig",
    "Peer",
    "PlanError",
    "Producer",
    "ProducerConfig",
    "ProducerState",
    "Publish",
    "PushKVError",
    "RankInfo",
    "ReadDone",
    "Register",
    "Rejected",
    "ReleaseDestination",
    "ReleaseSource",
    "ReleaseStaging",
    "RemoteProtocolError",
    "Scatter",
    "SendMessage",
    "Skip",
    "TransferCancelled",
    "TransferFailed",
    "TransferPlan",
    "TransferReady",
    "ValidationError",
    "assignment",
    "coalesce",
    "decode",
    "encode",
    "expected_writers",
    "new_incarnation",
    "plan_transfer",
    "targets_of",
    "uniform_ranks",
    "writers_of",
]
