"""The agent's job view: what it watches and how events change it."""

from __future__ import annotations

from keepstep.agent import protocol
from keepstep.agent.kv import MemoryKV, WatchEvent
from keepstep.agent.node.view import JobView

JOB = "demo"


def test_every_kind_the_view_acts_on_sorts_below_the_watch_end() -> None:
    below = protocol.watched_below(JOB)
    for kind in protocol.WATCHED_KINDS:
        assert protocol.key(JOB, kind, "n9/0") < below, kind
        assert protocol.key(JOB, kind) < below, kind
    for kind in ("progress", "recoveries"):
        assert protocol.key(JOB, kind, "n0") >= below, kind


def test_the_view_sees_membership_but_not_progress_through_its_watch() -> None:
    kv = MemoryKV()
    view = JobView(JOB, "n0")
    events: list[WatchEvent] = []

    def apply(event: WatchEvent) -> None:
        events.append(event)
        view.apply(event)

    kv.watch_prefix(protocol.job_prefix(JOB), apply, below=protocol.watched_below(JOB))
    epoch = protocol.EpochRecord(3, ["n0/0", "n1/0"])
    kv.put(protocol.key(JOB, "epoch"), protocol.encode(epoch), 1.0)
    kv.put(protocol.key(JOB, "pending", "n2/0"), b"{}", 1.0)
    kv.put(protocol.key(JOB, "leaving", "n1"), b"{}", 1.0)
    progress = protocol.ProgressRecord("n1", 7, 3, 2)
    kv.put(protocol.key(JOB, "progress", "n1"), protocol.encode(progress), 1.0)
    kv.put(protocol.key(JOB, "recoveries", "3-n1/0"), b"{}", 1.0)
    kv.put(protocol.key(JOB, "done", "n1-0"), b"{}", 1.0)
    kinds = [e.key[len(protocol.job_prefix(JOB)) :].partition("/")[0] for e in events]
    assert kinds == ["epoch", "pending", "leaving", "done"]
    seen = view.observe()
    assert seen.current == epoch
    assert seen.pending == {"n2/0"} and seen.leaving == {"n1"}
    assert view.job_finished
    # A progress event handed to the view anyway (the agent's first full read) is ignored.
    before = view.observe()
    change = view.apply(WatchEvent("put", protocol.key(JOB, "progress", "n0"), b"{}", 99))
    assert change == type(change)() and view.observe() == before


def test_a_report_of_the_last_epoch_finds_its_record_after_the_next_arrived() -> None:
    view = JobView(JOB, "n0")
    records = [protocol.EpochRecord(n, ["n0/0", f"n{n + 1}/0"]) for n in range(12)]
    for n, record in enumerate(records):
        view.apply(WatchEvent("put", protocol.key(JOB, "epoch"), protocol.encode(record), n + 1))
    assert view.observe().current == records[-1]
    assert view.epoch(10) == records[10] and view.epoch(11) == records[11]
    assert view.epoch(3) is None  # long settled: only the latest are kept
    assert view.epoch(12) is None
