"""The messages a worker and its node agent exchange over the local link, typed.

Where it sits: `link` frames these as JSON lines; the worker's side (`worker/link_client`,
`worker/controller`) sends requests and reads replies and pushes, the agent's side
(`node/link_server`, `node/requests`) decodes requests and dispatches on their type.
Dataclasses and JSON only: no pickle, no torch, so that either side decodes only data.

    worker -> agent, answered          Hello, Initial, Boundary, Failure, Finish, Hold
    worker -> agent, not answered      Commit, Reconfigured (reports, once a step at most),
                                       SlowDrain (once an epoch at most)
    agent -> worker, answers           MembershipReply, Excluded, NoChange, Ok, ErrorReply
    agent -> worker, pushed            PendingPush, GatesPush

On the wire a message is one JSON object: its `op` and its fields, e.g.
``{"op": "boundary", "member": "n0/0", "done": 12}``. `decode` refuses an unknown op, a
missing or unknown field, or a value of the wrong type with `BadMessage`, which names the
field. An agent that cannot answer sends an `ErrorReply` whose code the worker turns back
into the error type (`error_reply` / `error_of`; the errors live in `link_errors`), so
failures stay types across the link.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar

from keepstep.agent.protocol.link_errors import AdmissionTimeout as AdmissionTimeout
from keepstep.agent.protocol.link_errors import AgentError as AgentError
from keepstep.agent.protocol.link_errors import AgentUnresponsive as AgentUnresponsive
from keepstep.agent.protocol.link_errors import BadMessage as BadMessage
from keepstep.agent.protocol.link_errors import ErrorCode as ErrorCode
from keepstep.agent.protocol.link_errors import JobCannotContinue as JobCannotContinue
from keepstep.agent.protocol.link_errors import LinkError as LinkError


class Op(enum.StrEnum):
    HELLO = "hello"
    INITIAL = "initial"
    BOUNDARY = "boundary"
    FAILURE = "failure"
    FINISH = "finish"
    COMMIT = "commit"
    RECONFIGURED = "reconfigured"
    MEMBERSHIP = "membership"
    EXCLUDED = "excluded"
    NO_CHANGE = "no-change"
    OK = "ok"
    ERROR = "error"
    PENDING = "pending"
    HOLD = "hold"
    GATES = "gates"
    SLOW_DRAIN = "slow-drain"


# -- worker -> agent ---------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The worker imported everything and built its model: it can be admitted."""

    OP: ClassVar[Op] = Op.HELLO
    member: str


@dataclass(frozen=True)
class Initial:
    """Wait until an epoch admits the worker (epoch 0, a join, or after an exclusion)."""

    OP: ClassVar[Op] = Op.INITIAL
    member: str


@dataclass(frozen=True)
class Boundary:
    """A planned change was announced in the step that made `done`: agree it here."""

    OP: ClassVar[Op] = Op.BOUNDARY
    member: str
    done: int


@dataclass(frozen=True)
class Failure:
    """A collective of `epoch` failed after `done` committed steps: agree the survivors.
    `missing_state`: entering `epoch`, its members found sharded state none of them holds
    (a restarting worker holds it, or a double fault lost it): the next epoch must admit a
    worker from outside it."""

    OP: ClassVar[Op] = Op.FAILURE
    member: str
    epoch: int
    done: int
    reason: str
    missing_state: bool = False


@dataclass(frozen=True)
class Finish:
    """The worker trained to the end: its step count and parameter digest."""

    OP: ClassVar[Op] = Op.FINISH
    member: str
    done: int
    params_sha256: str


@dataclass(frozen=True)
class Commit:
    """A committed step (the library's `CommitRecord`, flat): a report, not answered."""

    OP: ClassVar[Op] = Op.COMMIT
    member: str
    step: int
    epoch: int
    world_size: int
    micro_batches: tuple[int, ...]
    samples: tuple[int, ...]
    step_s: float
    assignment: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    snapshot_s: float = 0.0
    skipped: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)
    compute_s: float = 0.0
    new_weights: Mapping[str, float] = field(default_factory=dict)  # a replan from speed


@dataclass(frozen=True)
class Reconfigured:
    """What the worker measured entering an epoch (the library's `Reconfiguration`)."""

    OP: ClassVar[Op] = Op.RECONFIGURED
    member: str
    epoch: int
    members: tuple[str, ...]
    communicator_s: float
    restore_s: float
    replan_s: float
    resume_step: int
    rolled_back_steps: int
    received_state: bool
    reshard_s: float = 0.0  # of restore_s: moving the sharded optimizer state into shards
    reshard_bytes: int = 0  # of that state, the bytes this worker received from peers


@dataclass(frozen=True)
class SlowDrain:
    """The worker's member stayed too slow (`keepstep.elastic.slow_drain.DrainRequest`):
    drain its node as a planned change, if the job can spare it. A report, not answered."""

    OP: ClassVar[Op] = Op.SLOW_DRAIN
    member: str
    epoch: int
    step: int
    ratio: float  # its speed / the median speed
    reason: str


@dataclass(frozen=True)
class Hold:
    """The worker reached a step gate (`done` steps committed): answered once it is open."""

    OP: ClassVar[Op] = Op.HOLD
    member: str
    done: int


# -- agent -> worker ---------------------------------------------------------------------
@dataclass(frozen=True)
class MembershipReply:
    """The epoch the worker trains in next; one that leaves it out tells it to leave."""

    OP: ClassVar[Op] = Op.MEMBERSHIP
    epoch: int
    members: tuple[str, ...]
    store: str  # host:port of the store the epoch's process group rendezvouses on
    timeout_scale: float = 1.0  # the epoch's store and collective timeouts, x their defaults
    # The epoch's secret key prefix in that store (`EpochRecord.token`; "" for none).
    token: str = field(default="", repr=False)
    # A fallback epoch (`EpochRecord.checkpoint_step` >= 0): the file holding the durable
    # checkpoint of that step as one snapshot, which the worker resumes from.
    checkpoint_step: int = -1
    checkpoint: str = ""


@dataclass(frozen=True)
class Excluded:
    """The job goes on in `epoch` without this worker for now: ask to be admitted again."""

    OP: ClassVar[Op] = Op.EXCLUDED
    epoch: int


@dataclass(frozen=True)
class NoChange:
    """Nothing was agreed at this boundary: train on in the same epoch."""

    OP: ClassVar[Op] = Op.NO_CHANGE


@dataclass(frozen=True)
class Ok:
    OP: ClassVar[Op] = Op.OK


@dataclass(frozen=True)
class ErrorReply:
    OP: ClassVar[Op] = Op.ERROR
    code: ErrorCode
    reason: str


@dataclass(frozen=True)
class PendingPush:
    """Whether a planned change (join, drain) waits for the next boundary."""

    OP: ClassVar[Op] = Op.PENDING
    pending: bool


@dataclass(frozen=True)
class GatesPush:
    """The steps of the job's gates that are not open: a worker that has committed one of
    them (or more) asks `Hold` before its next step."""

    OP: ClassVar[Op] = Op.GATES
    steps: tuple[int, ...]


Request = Hello | Initial | Boundary | Failure | Finish | Hold
Report = Commit | Reconfigured | SlowDrain
Reply = MembershipReply | Excluded | NoChange | Ok | ErrorReply
Push = PendingPush | GatesPush
Message = Request | Report | Reply | Push

_TYPES: dict[Op, type[Any]] = {
    cls.OP: cls
    for cls in (
        Hello,
        Initial,
        Boundary,
        Failure,
        Finish,
        Commit,
        Reconfigured,
        MembershipReply,
        Excluded,
        NoChange,
        Ok,
        ErrorReply,
        PendingPush,
        Hold,
        GatesPush,
        SlowDrain,
    )
}
assert set(_TYPES) == set(Op), "every op has exactly one message type"
# Each type's fields and their annotations (resolved once: decode checks values by them).
_HINTS: dict[type[Any], dict[str, Any]] = {
    cls: {f.name: typing.get_type_hints(cls)[f.name] for f in fields(cls)}
    for cls in _TYPES.values()
}


# -- encoding ----------------------------------------------------------------------------
def encode(message: Message) -> dict[str, Any]:
    """The JSON object of a message: its op and its fields (tuples as lists)."""
    out: dict[str, Any] = {"op": message.OP.value}
    for f in fields(message):
        out[f.name] = _plain(getattr(message, f.name))
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def decode(obj: object) -> Message:
    """The message of a JSON object; BadMessage names what is wrong with it."""
    if not isinstance(obj, dict):
        raise BadMessage(None, f"a link message is a JSON object, not {type(obj).__name__}")
    op = obj.get("op")
    if op is None:
        raise BadMessage("op", "missing")
    try:
        cls = _TYPES[Op(op)]
    except (ValueError, TypeError):
        raise BadMessage("op", f"unknown operation {op!r}") from None
    hints = _HINTS[cls]
    unknown = sorted(set(obj) - {"op", *hints})
    if unknown:
        raise BadMessage(unknown[0], f"not a field of {op!r}")
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in obj:
            values[f.name] = _check(obj[f.name], hints[f.name], f.name)
        elif _required(f):
            raise BadMessage(f.name, f"missing from {op!r}")
    message: Message = cls(**values)
    return message


def _required(f: Field[Any]) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` as the annotated type, or BadMessage naming `where` (field, index, key)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in hint)
            raise BadMessage(where, f"{value!r} is none of {allowed}") from None
    elif origin is tuple:
        if isinstance(value, list):
            return tuple(_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    elif origin is Mapping or origin is dict:
        if isinstance(value, dict):
            return {
                _check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()
            }
    else:
        raise TypeError(f"{where}: the link cannot carry {hint!r}")  # a bug in this module
    raise BadMessage(where, f"expected {_name(hint)}, got {type(value).__name__} {value!r}")


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


# -- errors across the link --------------------------------------------------------------
def error_reply(error: BaseException) -> ErrorReply:
    """The reply that carries `error` to the worker (its type as a code)."""
    if isinstance(error, BadMessage):
        return ErrorReply(ErrorCode.BAD_REQUEST, str(error))
    if isinstance(error, AdmissionTimeout):
        return ErrorReply(ErrorCode.ADMISSION_TIMEOUT, str(error))
    if isinstance(error, JobCannotContinue):
        return ErrorReply(ErrorCode.JOB_CANNOT_CONTINUE, str(error))
    return ErrorReply(ErrorCode.FAILED, f"{type(error).__name__}: {error}")


def error_of(reply: ErrorReply) -> LinkError:
    """The error a worker raises for an agent's ErrorReply."""
    if reply.code is ErrorCode.ADMISSION_TIMEOUT:
        return AdmissionTimeout(reply.reason)
    if reply.code is ErrorCode.JOB_CANNOT_CONTINUE:
        return JobCannotContinue(reply.reason)
    return AgentError(reply.code, reply.reason)
