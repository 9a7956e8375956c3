"""The etcd key layout of a job and the records stored under it.

Agents write these keys; the operator reads them to fill TrainJob status (this module
imports neither torch nor an etcd client, so the operator may import it). Records are
JSON; every field has a type and a default so that old readers survive new fields.

    /keepstep/jobs/<job>/epoch            EpochRecord   the agreed membership (CAS)
    /keepstep/jobs/<job>/gates/<name>     GateRecord    hold the job at a step boundary while
                                          a scheduled fault is injected (CAS; GateState)
    /keepstep/jobs/<job>/nodes/<node>     NodeRecord    one per live agent (leased)
    /keepstep/jobs/<job>/pending/<member> PendingRecord a worker waiting to be admitted
    /keepstep/jobs/<job>/leaving/<node>   LeavingRecord a node draining at the next boundary
    /keepstep/jobs/<job>/progress/<node>  ProgressRecord committed step, rates
    /keepstep/jobs/<job>/recoveries/<e-m> what member m measured entering epoch e: its
                                          "reconfigured" event's fields, and mttr_s (from
                                          its node's detection) once it committed there
    /keepstep/jobs/<job>/done/<node>-<r>  DoneRecord    a worker (member <node>/<r>) finished

A whole recovery (cause, every phase, MTTR) is not stored in etcd: no member sees all of
it. `protocol.recovery.RecoveryRecord` is folded from the event logs instead.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

ROOT = "/keepstep/jobs/"

T = TypeVar("T")


def job_prefix(job: str) -> str:
    return f"{ROOT}{job}/"


def key(job: str, kind: str, name: str = "") -> str:
    """The key of a record: key(job, "epoch") or key(job, "nodes", "n0")."""
    return f"{job_prefix(job)}{kind}" + (f"/{name}" if name else "")


def prefix(job: str, kind: str) -> str:
    return f"{job_prefix(job)}{kind}/"


# The kinds an agent acts on (view.py). They sort before "progress", so an agent watches
# only the keys below `watched_below`: progress (a put per node several times a second)
# and recovery records would otherwise wake every agent of the job for nothing.
WATCHED_KINDS = ("done", "epoch", "leaving", "nodes", "pending")
# Step gates sort below "progress" too: the agent's one watch sees them (`node/gates`).
GATES = "gates"
assert GATES < "progress" and all(kind < "progress" for kind in WATCHED_KINDS)


def watched_below(job: str) -> str:
    """Where the keys an agent watches end (exclusive); see WATCHED_KINDS."""
    return key(job, "progress")


def member_id(node: str, local_rank: int) -> str:
    """A worker's member id: its node and local rank (sorts by node, then rank)."""
    return f"{node}/{local_rank}"


def node_of(member: str) -> str:
    return member.rpartition("/")[0]


def encode(record: Any) -> bytes:
    return json.dumps(asdict(record), sort_keys=True).encode()


def decode(cls: type[T], raw: bytes) -> T:
    data = json.loads(raw)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    members: list[str]
    reason: str = ""
    start_step: int = 0
    created_at: float = 0.0
    store: str = ""  # host:port of the store the epoch's process group rendezvouses on
    # How much longer than their defaults the epoch's store and collective waits are: raised
    # after an epoch that ended although every member still answered (a loaded machine).
    timeout_scale: float = 1.0
    # The epoch's secret: a random prefix, made by the agent that proposes the record, under
    # which every key the epoch writes in its store lives (its gloo rendezvous, its abort and
    # wake keys). A store has no key listing, so whoever can reach the store's port but not
    # read this record can neither read nor write the epoch's keys. Empty: no prefix (a
    # record written before tokens existed). Never logged or written to events.
    token: str = field(default="", repr=False)
    # >= 0: the sharded state this epoch needs was lost with every holder (a double fault),
    # so every member resumes from the job's durable checkpoint of this step instead of
    # its own snapshot; -1: members resume from their snapshots, as always.
    checkpoint_step: int = -1

    def nodes(self) -> list[str]:
        return sorted({node_of(m) for m in self.members})

    def leader(self) -> str:
        """The node that decides planned changes: the first node of the epoch."""
        return self.nodes()[0]


@dataclass(frozen=True)
class NodeRecord:
    node: str
    host: str
    probe_port: int
    pid: int
    workers: dict[str, int] = field(default_factory=dict)  # member -> pid
    started_at: float = 0.0
    store_port: int = 0  # the process-group store this agent hosts, on `host`

    def store_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.store_port}"


@dataclass(frozen=True)
class PendingRecord:
    member: str
    since: float = 0.0
    has_state_step: int = -1


@dataclass(frozen=True)
class LeavingRecord:
    node: str
    since: float = 0.0


@dataclass(frozen=True)
class ProgressRecord:
    node: str
    step: int
    epoch: int
    world_size: int
    samples_per_s: float = 0.0
    last_mttr_s: float | None = None
    updated_at: float = 0.0
    # Bytes of this node's snapshot files (in /dev/shm on a pod): the operator sizes the
    # memory-backed /dev/shm of the pods it creates from the largest report.
    snapshot_bytes: int = 0


@dataclass(frozen=True)
class DoneRecord:
    node: str
    steps: int
    params_sha256: str


class GateState(enum.StrEnum):
    """Where a step gate is. Whoever schedules a fault at step K (the launcher, the chaos
    injector) arms a gate at K; every agent holds its workers at the boundary where K
    steps are committed while the gate is not open; the first agent there marks it held;
    the armer claims it, injects, and releases it. Every move is a compare-and-set on the
    record's revision, so exactly one side makes each::

        ARMED --an agent: a worker reached the step--> HELD --armer: claims--> FIRING
        ARMED, EXPIRED --armer: the job passed the step unheld (late)--> FIRING
        FIRING --armer: injected--> RELEASED
        HELD --an agent: nobody claimed it within its hold bound--> EXPIRED
    """

    ARMED = "armed"
    HELD = "held"
    FIRING = "firing"
    RELEASED = "released"
    EXPIRED = "expired"

    @property
    def open(self) -> bool:
        """Workers pass the gate's boundary without waiting."""
        return self in (GateState.RELEASED, GateState.EXPIRED)


@dataclass(frozen=True)
class GateRecord:
    """A step gate. `step`: the boundary it holds (steps committed); `held_step`: the
    steps committed when it was held or claimed (`step`, or more for a gate the job
    reached late); `node`: the agent that held it."""

    name: str
    step: int
    state: GateState = GateState.ARMED
    node: str = ""
    held_step: int = -1
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", GateState(self.state))  # a str, when decoded

    def closes(self, done: int) -> bool:
        """Whether a worker that has committed `done` steps waits at this gate."""
        return not self.state.open and self.step <= done
