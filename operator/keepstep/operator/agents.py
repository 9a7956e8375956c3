"""The operator's side of the job etcd: read a job's agent records, claim and clear its prefix.

Where it sits: `reconcile` calls `AgentStore.read` for the `AgentView` that `decide` takes,
and `AgentStore.claim` / `AgentStore.forget` to carry out `ClaimPrefix` and the finalizer.
It reaches etcd only through a `keepstep.agent.kv.KVStore` (an `EtcdKV` in the operator,
the in-memory fake in unit tests) and decodes with `keepstep.agent.protocol`.

The store also remembers when it last saw each node's leased record: a record that has
vanished says nothing about *when*, and the lost-pod grace needs that time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from keepstep.agent import protocol
from keepstep.agent.kv import KV, KVStore
from keepstep.operator.actions import ClaimPrefix
from keepstep.operator.model import AgentView, Recovery

log = logging.getLogger(__name__)

OWNER_KIND = "operator"  # the key the operator stamps: /keepstep/jobs/<job>/operator


@dataclass(frozen=True)
class OwnerRecord:
    """Which TrainJob (by uid) the records under a prefix belong to."""

    uid: str
    claimed_at: float = 0.0


def _recovery(name: str, raw: bytes) -> Recovery | None:
    data: Any = json.loads(raw)
    if not isinstance(data, Mapping):
        return None
    # Keys are "<epoch>-<member>"; the record may carry the epoch itself.
    head = name.partition("-")[0]
    epoch = data.get("epoch", int(head) if head.isdigit() else 0)
    mttr = data.get("mttr_s")
    member = str(data.get("member") or data.get("node") or name.partition("-")[2])
    return Recovery(int(epoch), member, float(mttr) if isinstance(mttr, int | float) else None)


def parse_records(job_key: str, kvs: Iterable[KV], last_seen: Mapping[str, float]) -> AgentView:
    """The AgentView of one job from the keys under its prefix (pure; skips bad records)."""
    base = protocol.job_prefix(job_key)
    owner: str | None = None
    nodes: dict[str, protocol.NodeRecord] = {}
    progress: dict[str, protocol.ProgressRecord] = {}
    done: dict[str, protocol.DoneRecord] = {}
    recoveries: list[Recovery] = []
    epoch: protocol.EpochRecord | None = None
    records = 0
    for kv in kvs:
        rel = kv.key[len(base) :] if kv.key.startswith(base) else kv.key
        kind, _, name = rel.partition("/")
        try:
            if kind == OWNER_KIND and not name:
                owner = protocol.decode(OwnerRecord, kv.value).uid
                continue
            records += 1
            if kind == "epoch" and not name:
                epoch = protocol.decode(protocol.EpochRecord, kv.value)
            elif kind == "nodes":
                nodes[name] = protocol.decode(protocol.NodeRecord, kv.value)
            elif kind == "progress":
                progress[name] = protocol.decode(protocol.ProgressRecord, kv.value)
            elif kind == "done":
                done[name] = protocol.decode(protocol.DoneRecord, kv.value)
            elif kind == "recoveries":
                recovery = _recovery(name, kv.value)
                if recovery is not None:
                    recoveries.append(recovery)
        except (ValueError, TypeError, KeyError) as error:
            log.warning("skipping unreadable record %s: %s", kv.key, error)
    return AgentView(
        owner_uid=owner,
        nodes=nodes,
        epoch=epoch,
        progress=progress,
        recoveries=tuple(recoveries),
        done=done,
        last_seen=dict(last_seen),
        records=records,
    )


class AgentStore:
    """Reads and claims job prefixes; every call takes the store's timeout (seconds) and
    raises `keepstep.agent.kv.KVError` when etcd fails or cannot be reached."""

    def __init__(
        self, kv: KVStore, timeout: float = 5.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.kv, self.timeout, self.clock = kv, timeout, clock
        self._lock = threading.Lock()
        self._last_seen: dict[str, dict[str, float]] = {}
        self.reads = 0
        self.writes = 0

    def read(self, job_key: str) -> AgentView:
        kvs = self.kv.get_prefix(protocol.job_prefix(job_key), self.timeout)
        now = self.clock()
        with self._lock:
            self.reads += 1
            seen = self._last_seen.setdefault(job_key, {})
            view = parse_records(job_key, kvs, seen)
            for node in view.nodes:
                seen[node] = now
        return view

    def claim(self, action: ClaimPrefix) -> None:
        """Stamp the prefix with the job's uid, first clearing it if `action.reset`."""
        record = protocol.encode(OwnerRecord(action.uid, self.clock()))
        if action.reset:
            deleted = self.kv.delete_prefix(protocol.job_prefix(action.job_key), self.timeout)
            log.info("cleared %d keys of job %s", deleted, action.job_key)
            with self._lock:
                self._last_seen.pop(action.job_key, None)
        self.kv.put(protocol.key(action.job_key, OWNER_KIND), record, self.timeout)
        with self._lock:
            self.writes += 1 + int(action.reset)

    def forget(self, job_key: str) -> int:
        """Delete every key of the job (its TrainJob is being deleted)."""
        deleted = self.kv.delete_prefix(protocol.job_prefix(job_key), self.timeout)
        with self._lock:
            self._last_seen.pop(job_key, None)
            self.writes += 1
        return deleted
