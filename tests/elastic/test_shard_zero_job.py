"""ZeRO-1 and ZeRO-2 in the job with real processes on gloo: the numbers of the unsharded run.

Members train shard_zero_job.py with ``shard="zero1"`` (ZeRO-2: ``"zero2"``, the reduced
gradient reduce-scattered to the owners too): each steps the optimizer state of
its own shard, the parameters are all-gathered over the epoch's communicator, and its
snapshots keep its own chunks of the state and a replica of another member's. Every
run must end with the parameters (``params_sha256``) and the gathered optimizer state of
the same job trained by one member with a full optimizer, whatever the member count, and
after a member is lost mid-run (the survivors rebuild their shards from the snapshot).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from keepstep.elastic.sharded_snapshot import take_pieces
from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore
from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local

SCRIPT = str(Path(__file__).resolve().parent / "shard_zero_job.py")
STEPS = 12

pytestmark = pytest.mark.slow


def members(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def launch(
    tmp: Path,
    schedule: list[list[str]],
    *args: str,
    crashed: tuple[str, ...] = (),
    **kw: Any,
) -> LocalResult:
    """Run the job; ``crashed``: members the script kills (besides the launcher's crash).

    Store and collective timeouts are raised 4x: on a loaded machine a joiner's start-up
    can keep a member's store reads waiting past the default 2 s, which would read as a
    lost store (no fault here is a hang, so only the detection of one would be slower).
    """
    kw.setdefault("timeout_scale", 4.0)
    run = LocalRun(
        script=SCRIPT,
        steps=STEPS,
        global_batch=48,  # 12 micro-batches: 3 each for 4 members, 4 each for 3
        micro_batch=4,
        schedule=schedule,
        seed=3,
        script_args=args,
        timeout=150.0,
        **kw,
    )
    result = run_local(run, tmp)
    killed = set(kw.get("crash", {})) | set(crashed)
    for member, code in result.returncodes.items():
        expected = -9 if member in killed else 0
        assert code == expected, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
    return result


def figures(result: LocalResult, tmp: Path) -> dict[str, dict[str, Any]]:
    """What every finishing member wrote beside its result (shard_zero_job.py)."""
    out = {}
    for m in result.finished():
        out[m] = json.loads((tmp / f"result-{m}.json.optim").read_text())
    return out


def hashes(result: LocalResult, tmp: Path) -> tuple[str, str]:
    """The agreed params_sha256 and the one optimizer-state hash every finisher wrote."""
    optim = {f["optimizer_sha256"] for f in figures(result, tmp).values()}
    assert len(optim) == 1, optim
    return agreed_sha(result), optim.pop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("full-1")
    return hashes(launch(tmp, [members(1)]), tmp)


def test_four_members_zero1_match_one_full_member(
    reference: tuple[str, str], tmp_path: Path
) -> None:
    result = launch(tmp_path, [members(4)], "--shard", "zero1")
    assert hashes(result, tmp_path) == reference
    sizes = {r["world_size_by_step"][str(STEPS - 1)] for r in result.results.values()}
    assert sizes == {4}
    # Each member owns a quarter of the elements (to the 128-element alignment), and steps
    # optimizer state for its windows only: AdamW's two float32 moments and a step count.
    found = figures(result, tmp_path)
    owned = {m: f["owned_elements"] for m, f in found.items()}
    total = 8 * 96 + 96 + 96 * 33 + 33 + 33 + 1
    assert sum(owned.values()) == total and max(owned.values()) <= total // 4 + 128
    full_bytes = 2 * 4 * total + 4 * 6
    shard_bytes = {m: f["shard_state_bytes"] for m, f in found.items()}
    print(f"optimizer state bytes per member {shard_bytes} of {full_bytes} unsharded")
    assert all(b < full_bytes / 2 for b in shard_bytes.values())
    # Each snapshot keeps the member's pieces (own chunks and a replica: about 2/W of the
    # state) in one checked payload, and none of the optimizer's own per-parameter state.
    kept = {}
    for m in members(4):
        snap = SnapshotStore(FileBuffer.open_or_create(str(tmp_path / f"snapshot-{m}"))).load()
        assert not any(k.startswith("optim/") and "/groups/" not in k for k in snap.tensors)
        extra = {n.removeprefix("extra/"): t for n, t in snap.tensors.items()}
        pieces = take_pieces(extra)  # its segments, joined
        assert pieces is not None
        kept[m] = pieces.numel()
    print(f"snapshot optimizer bytes per member {kept} of {full_bytes} unsharded")
    assert all(b < 0.75 * full_bytes for b in kept.values())


def test_four_full_members_match_one(reference: tuple[str, str], tmp_path: Path) -> None:
    assert hashes(launch(tmp_path, [members(4)]), tmp_path) == reference


SHARDS = pytest.mark.parametrize("shard", ["zero1", "zero2"])


@SHARDS
def test_a_lost_member_leaves_the_numbers_of_the_fault_free_run(
    reference: tuple[str, str], tmp_path: Path, shard: str
) -> None:
    # m3 is killed after committing step 5; the three survivors enter the next epoch,
    # join the full state from the pieces their snapshots keep (m3's chunks from their
    # replicas) and cut three shards from it.
    result = launch(
        tmp_path,
        [members(4), members(3)],
        "--shard",
        shard,
        at_step=[0, None],
        crash={"m3": 5},
    )
    assert hashes(result, tmp_path) == reference
    by_step = {int(k): v for k, v in result.results["m0"]["world_size_by_step"].items()}
    assert by_step[0] == 4 and by_step[STEPS - 1] == 3
    # Entering, each survivor fetched only what it lacked, by rank-to-rank transfers:
    # ZeRO-2 at most the lost member's share of the two Adam moments (plus headers);
    # ZeRO-1 also the replicas it keeps in the new epoch (it steps them from the first
    # commit on, so no commit sends state): what m3 held, its own chunks and replicas.
    entered = {
        (m, r["epoch"]): r
        for m in ("m0", "m1", "m2")
        for r in result.results[m]["reconfigurations"]
    }
    total = sum(entered[m, 1]["stepped_elements"] for m in ("m0", "m1", "m2"))
    lost = total - sum(entered[m, 0]["stepped_elements"] for m in ("m0", "m1", "m2"))
    moved = sum(entered[m, 1]["reshard_bytes"] for m in ("m0", "m1", "m2"))
    assert 0 < lost < total / 2
    if shard == "zero2":
        assert 0 <= moved <= 1.1 * lost * 2 * 4 + 3 * 4096
    else:  # m3 kept about twice the elements it stepped
        assert 1.5 * lost * 2 * 4 <= moved <= 1.1 * 2 * lost * 2 * 4 + 3 * 4096
    print(f"m3's {lost} of {total} elements lost; survivors received {moved} bytes")


@SHARDS
def test_a_member_lost_inside_the_sharded_step_fails_the_step_not_the_numbers(
    reference: tuple[str, str], tmp_path: Path, shard: str
) -> None:
    # m1 dies in step 7's parameter all-gather: the others have stepped their shards and
    # wait in it. They get PeerLost there, do not commit step 7, restore the snapshot of
    # step 7 (undoing the half-updated parameters) and repeat it with three shards.
    result = launch(
        tmp_path,
        [members(4), ["m0", "m2", "m3"]],
        "--shard",
        shard,
        "--die-in-gather",
        "m1:7",
        at_step=[0, None],
        crashed=("m1",),
    )
    assert hashes(result, tmp_path) == reference
    m0 = result.results["m0"]
    by_step = {int(k): v for k, v in m0["world_size_by_step"].items()}
    assert by_step[6] == 4 and by_step[7] == 3
    (recovery,) = [r for r in m0["reconfigurations"] if r["epoch"] == 1]
    assert recovery["resume_step"] == 7


@SHARDS
def test_a_drain_then_a_join_keep_the_numbers(
    reference: tuple[str, str], tmp_path: Path, shard: str
) -> None:
    # m3 drains at step 4; m4 joins at step 8 and gets the (full) snapshot by network.
    schedule = [members(4), members(3), [*members(3), "m4"]]
    result = launch(tmp_path, schedule, "--shard", shard, at_step=[0, 4, 8])
    assert hashes(result, tmp_path) == reference
    joiner = result.results["m4"]
    assert any(r["received_state"] for r in joiner["reconfigurations"])
