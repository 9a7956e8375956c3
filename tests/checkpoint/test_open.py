"""`keepstep checkpoint ls` and `export` on checkpoints laid out by the real writer.

Each test writes snapshots of a small model, its AdamW and tracked state (an LR schedule
and a counter object holding a frozenset) through `capture`, `SnapshotStore.export` and
`CheckpointWriter`, as a node agent does, then runs the command in-process. The hashes it
must report are `Job.params_sha256` / `TrackedState.sha256` of the live objects, run on a
stand-in for the job. tests/checkpoint/test_from_a_run.py does the same with `keepstep run`.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from keepstep.agent.durable.writer import CheckpointWriter, blob_name, info_name
from keepstep.checkpoint.contents import params_sha256
from keepstep.cli import main
from keepstep.elastic.job import Job
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore
from keepstep.elastic.tracked import TrackedState
from keepstep.elastic.train_state import capture

T = 30.0
STEPS = (2, 4)


class Counter:
    """Script state of plain values, a tensor and a frozenset."""

    def __init__(self) -> None:
        self.seen = 0
        self.tags: frozenset[str] = frozenset()
        self.total = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "tags": self.tags, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.tags, self.total = state["seen"], frozenset(state["tags"]), state["total"]


@dataclass
class Parts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sched: LambdaLR
    counter: Counter
    tracked: TrackedState


def make_parts() -> Parts:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = LambdaLR(optimizer, lambda i: 1.0 / (1 + i))
    counter = Counter()
    tracked = TrackedState()
    tracked.add("sched", sched)
    tracked.add("counter", counter)
    return Parts(model, optimizer, sched, counter, tracked)


def job_sha(model: nn.Module, tracked: TrackedState) -> str:
    """`Job.params_sha256` itself, on a stand-in for the job."""
    sha: str = Job.params_sha256(types.SimpleNamespace(model=model, tracked=tracked))
    return sha


@dataclass
class Written:
    url: str
    root: Path
    sha: dict[int, str]  # step -> Job.params_sha256 at that step
    model_sha: dict[int, str]  # the same with nothing tracked: the model's alone
    state_sha: dict[int, dict[str, str]]
    optimizer: dict[int, dict[str, Any]]  # step -> optimizer.state_dict() (copied)


@pytest.fixture
def written(tmp_path: Path) -> Written:
    parts = make_parts()
    root = tmp_path / "ckpt"
    url = f"file://{root}"
    store = SnapshotStore(MemoryBuffer(), background=False)
    writer = CheckpointWriter(url, every_steps=1, keep=len(STEPS))
    sha, model_sha, state_sha, optim = {}, {}, {}, {}
    x = torch.randn(16, 4)
    for step in range(1, max(STEPS) + 1):
        parts.optimizer.zero_grad()
        parts.model(x).square().mean().backward()
        parts.optimizer.step()
        parts.sched.step()
        parts.counter.seen += 16
        parts.counter.tags = frozenset({*parts.counter.tags, f"s{step}"})
        parts.counter.total += step
        if step in STEPS:
            state = capture(step, parts.model, parts.optimizer, None, parts.tracked)
            store.commit(step, state.tensors, state.meta)
            writer.submit(step, store.export(step))
            writer.flush(T)
            sha[step] = job_sha(parts.model, parts.tracked)
            model_sha[step] = job_sha(parts.model, TrackedState())
            state_sha[step] = {n: parts.tracked.sha256(n) for n in parts.tracked.names}
            optim[step] = _cloned(parts.optimizer.state_dict())
    writer.close(T)
    return Written(url, root, sha, model_sha, state_sha, optim)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def ls(url: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, dict[str, Any]]:
    code = main(["checkpoint", "ls", "--json", *flags, url])
    listing: dict[str, Any] = json.loads(capsys.readouterr().out)
    return code, listing


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_every_step_with_the_hashes_the_job_reports(
    written: Written, capsys: pytest.CaptureFixture[str]
) -> None:
    code, listing = ls(written.url, capsys)
    assert code == 0
    assert listing["latest"] == listing["newest"] == 4
    steps = {s["step"]: s for s in listing["steps"]}
    assert list(steps) == list(STEPS)
    for step, s in steps.items():
        assert s["status"] == "intact"
        assert s["params_sha256"] == written.sha[step]
        assert s["state_sha256"] == written.state_sha[step]
        assert s["nbytes"] == (written.root / blob_name(step)).stat().st_size
    assert written.sha[2] != written.sha[4]
    # --quick reads the records only: nothing verified, nothing hashed.
    code, quick = ls(written.url, capsys, "--quick")
    assert code == 0 and quick["newest"] == 4 and not quick["verified"]
    assert [(s["status"], s["params_sha256"]) for s in quick["steps"]] == [("published", None)] * 2
    # The table says the same.
    code, out, _ = run_main(["checkpoint", "ls", written.url], capsys)
    assert code == 0
    assert f"{written.sha[4]}  newest" in out and written.sha[2] in out


def test_export_opens_with_plain_torch_load_into_fresh_objects(
    written: Written, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export.pt"
    code, printed, _ = run_main(["checkpoint", "export", written.url, str(out)], capsys)
    assert code == 0
    assert f"wrote {out}: step 4, {out.stat().st_size} B, torch" in printed
    assert f"params_sha256 {written.sha[4]}" in printed
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == 4 and saved["params_sha256"] == written.sha[4]
    assert saved["state_sha256"] == written.state_sha[4]
    assert saved["source"] == f"{written.url}/{blob_name(4)}"
    fresh = make_parts()
    fresh.model.load_state_dict(saved["model"])
    fresh.optimizer.load_state_dict(saved["optimizer"])
    _same(fresh.optimizer.state_dict(), written.optimizer[4])
    assert list(saved["state"]) == ["sched", "counter"]
    assert saved["state"]["counter"]["tags"] == {"s1", "s2", "s3", "s4"}  # a set: loadable
    for name, obj in zip(fresh.tracked.names, fresh.tracked.objects(), strict=True):
        obj.load_state_dict(saved["state"][name])
    assert job_sha(fresh.model, fresh.tracked) == written.sha[4]
    assert params_sha256(saved["model"], fresh.tracked) == written.sha[4]
    # An older step, by number.
    older = tmp_path / "older.pt"
    assert main(["checkpoint", "export", "--step", "2", written.url, str(older)]) == 0
    assert torch.load(older, weights_only=True)["params_sha256"] == written.sha[2]


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_usage_errors_name_the_value(
    written: Written, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.pt"
    code, _, err = run_main(["checkpoint", "export", "--step", "3", written.url, str(out)], capsys)
    assert code == 2
    there = f"no checkpoint of step 3 at {written.url}; steps there: 2, 4"
    assert err == f"keepstep: error: --step 3: {there}\n"
    out.write_bytes(b"mine")
    code, _, err = run_main(["checkpoint", "export", written.url, str(out)], capsys)
    assert code == 2 and err == f"keepstep: error: OUT {out}: exists; --force overwrites it\n"
    assert out.read_bytes() == b"mine"
    assert main(["checkpoint", "export", "--force", written.url, str(out)]) == 0
    assert torch.load(out, weights_only=True)["step"] == 4
    empty = f"file://{tmp_path}/nothing"
    code, _, err = run_main(["checkpoint", "ls", empty], capsys)
    assert code == 2 and err == f"keepstep: error: {empty}: no checkpoint there\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file


def test_a_missing_step_is_refused_before_torch_is_imported(
    written: Written, tmp_path: Path
) -> None:
    probe = (
        "import atexit, sys\n"
        "from keepstep.cli import main\n"
        "atexit.register(lambda: sys.stderr.write(f\"probe: torch={'torch' in sys.modules}\\n\"))\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["checkpoint", "export", "--step", "7", written.url, str(tmp_path / "o.pt")]
    proc = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"keepstep: error: --step 7: no checkpoint of step 7 at {written.url}; steps there: 2, 4",
        "probe: torch=False",
    ]


def test_a_damaged_blob_is_named_and_the_older_step_still_exports(
    written: Written, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = written.root / blob_name(4)
    raw = bytearray(blob.read_bytes())
    raw[-100] ^= 0xFF
    blob.write_bytes(bytes(raw))
    code, listing = ls(written.url, capsys)
    assert code == 0 and listing["newest"] == 2  # what a resumed job would start from
    damaged = listing["steps"][1]
    assert damaged["status"] == "damaged" and "its record says" in damaged["reason"]
    out = tmp_path / "out.pt"
    code, _, err = run_main(["checkpoint", "export", written.url, str(out)], capsys)
    assert code == 1 and not out.exists()
    assert err.startswith(f"keepstep: error: {written.url}/{blob_name(4)}: {len(raw)} B with ")
    assert err.count("\n") == 1
    # A record rewritten to match the damaged blob: the slot's own checksum still catches it.
    record = json.loads((written.root / info_name(4)).read_text())
    record["sha256"] = hashlib.sha256(bytes(raw)).hexdigest()
    (written.root / info_name(4)).write_text(json.dumps(record))
    (written.root / "latest.json").write_text(json.dumps(record))
    code, _, err = run_main(["checkpoint", "export", written.url, str(out)], capsys)
    assert code == 1
    assert err == (
        "keepstep: error: checkpoint of step 4: payload checksum mismatch; "
        "other steps there (--step N): 2\n"
    )
    assert main(["checkpoint", "export", "--step", "2", written.url, str(out)]) == 0


def test_steps_no_latest_json_names_are_listed_as_incomplete(
    written: Written, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (written.root / "latest.json").unlink()
    code, listing = ls(written.url, capsys)
    assert code == 1 and listing["newest"] is None
    assert [s["status"] for s in listing["steps"]] == ["incomplete", "incomplete"]
    code, _, err = run_main(["checkpoint", "export", written.url, str(tmp_path / "o.pt")], capsys)
    assert code == 1 and "no complete checkpoint (no latest.json" in err


def test_a_damaged_latest_json_and_a_lost_blob_are_shown(
    written: Written, capsys: pytest.CaptureFixture[str]
) -> None:
    (written.root / "latest.json").write_text("{not json")
    (written.root / blob_name(2)).unlink()
    code, listing = ls(written.url, capsys)
    assert code == 0 and listing["latest"] is None and listing["newest"] == 4
    assert "not a checkpoint record" in listing["note"]  # then every step present counts
    lost, kept = listing["steps"]
    assert (lost["status"], lost["reason"]) == ("missing", f"no blob {blob_name(2)}")
    assert kept["status"] == "intact" and kept["params_sha256"] == written.sha[4]


def test_safetensors_needs_its_package(
    written: Written, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    out = tmp_path / "model.safetensors"
    argv = ["checkpoint", "export", "--format", "safetensors", written.url, str(out)]
    code, _, err = run_main(argv, capsys)
    assert code == 1 and not out.exists()
    assert err == (
        "keepstep: error: --format safetensors needs the safetensors package, which is not "
        "installed: pip install safetensors (or use --format torch)\n"
    )


def test_safetensors_holds_the_model_and_the_hash(
    written: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded: dict[str, Any] = {}
    if importlib.util.find_spec("safetensors") is None:
        # Not installed here: a stand-in records what the package would be asked to write.
        def save_file(tensors: dict[str, torch.Tensor], path: str, metadata: Any) -> None:
            recorded.update(tensors=tensors, metadata=metadata)
            Path(path).write_bytes(b"safetensors")

        package = types.ModuleType("safetensors")
        package.__spec__ = importlib.machinery.ModuleSpec("safetensors", None)
        package.torch = types.SimpleNamespace(save_file=save_file)
        monkeypatch.setitem(sys.modules, "safetensors", package)
        monkeypatch.setitem(sys.modules, "safetensors.torch", package.torch)
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", "--format", "safetensors", written.url, str(out)]) == 0
    if recorded:
        tensors, meta = recorded["tensors"], recorded["metadata"]
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file

        tensors = load_file(str(out))
        with safe_open(str(out), "pt") as f:
            meta = f.metadata()
    fresh = make_parts()
    fresh.model.load_state_dict(tensors)
    assert job_sha(fresh.model, TrackedState()) == written.model_sha[4]
    assert meta == {
        "step": "4",
        "params_sha256": written.sha[4],
        "tracked_state": "sched,counter",
        "source": f"{written.url}/{blob_name(4)}",
    }
