"""Tests of keepstep.elastic.zero: ZeRO-1 gives the unsharded step's bits at any world size.

Every case trains the same parameters twice on the same gradients (as the exact reduction
would hand them over): once with the script's optimizer on the full parameters (the
reference), once sharded over W ranks. The sha256 of the parameters and of the gathered
optimizer state must be equal. Fast tests run the ranks on threads of this process (the
``LocalGathers`` fake); the slow one starts W processes on gloo over loopback: this file
run as a script is the worker (``python test_zero.py PORT WORLD RANK``), reporting one
JSON line prefixed with ``RESULT ``, as in test_comm_workers.py.
"""

from __future__ import annotations

import faulthandler
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import test_zero_muon as muon_case
import torch

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import PrefixStore, TCPStore
from zero_scenario import (
    CONFIGS,
    CPU,
    OPT,
    SHAPES,
    STEPS,
    TIMEOUT,
    chunked,
    clone_value,
    make_optimizer,
    make_params,
    on_threads,
    owning,
    params_sha,
    reference,
    set_grads,
    sizes,
    state_sha,
    train_sharded,
)

from keepstep.elastic.errors import BadMessage, ConfigError, StateShapeError
from keepstep.elastic.shard import Range, make_chunk_layout, make_layout
from keepstep.elastic.zero import (
    ALIGN,
    GroupGather,
    LocalGathers,
    Ownership,
    Window,
    ZeroOptimizer,
    windows,
)
from keepstep.elastic.zero.state import pack_owned, unpack_full

# ---- ownership and windows --------------------------------------------------------------


def test_ownership_needs_exactly_one_owner_per_element() -> None:
    cases: list[tuple[list[list[tuple[int, int]]], str]] = [
        ([[(0, 5)], [(4, 10)]], "element 4 is owned twice"),
        ([[(0, 5)], [(6, 10)]], "element 5 is owned by no rank"),
        ([[(0, 5)], [(5, 9)]], "element 9 is owned by no rank"),
        ([[(5, 10), (0, 5)], []], "rank 0: ranges must be sorted and disjoint"),
        ([[(0, 11)]], "must be a non-empty Range inside [0, 10)"),
        ([[(0, 0), (0, 10)]], "must be a non-empty Range"),
    ]
    for ranges, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            owning((4, 6), ranges)
    own = owning((4, 0, 6), [[(0, 3), (8, 10)], [(3, 8)]])
    assert own.pieces(0) == [(0, 0, 3), (2, 4, 6)]
    assert own.pieces(1) == [(0, 3, 4), (2, 0, 4)]
    assert [own.owner_of(e) for e in range(10)] == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    assert [own.anchor(t) for t in range(3)] == [0, 1, 1]  # the empty tensor: next element's
    assert (own.owned(0), own.owned(1)) == (5, 5)


def test_ownership_from_a_shard_layout_is_in_rank_order() -> None:
    members = ["n0/0", "n0/1", "n1/0", "n1/1"]
    layout = make_layout(sizes(), members)
    own = Ownership.from_layout(layout, members)  # ranks: the communicator's sorted names
    assert [r[0] for r in own.ranges] == [layout.shard(m) for m in members]
    with pytest.raises(ConfigError, match="must be the layout's members"):
        Ownership.from_layout(layout, members[:3])


def test_zero_optimizer_accepts_a_chunked_layout() -> None:
    """A chunked layout gives each rank many ranges (slices of chunks its node owns); the
    sharded step over them, and over the layout after a node is lost, keeps the bits."""
    members = ["n0/0", "n0/1", "n1/0", "n2/0"]
    layout = make_chunk_layout(sizes(), members, align=ALIGN, chunk=2 * ALIGN)
    ownership = Ownership.from_chunk_layout(layout, members)
    assert max(len(r) for r in ownership.ranges) > 1
    assert [list(r) for r in ownership.ranges] == [list(layout.ranges(m)) for m in members]
    config = CONFIGS["adamw"]
    params, opt = reference(config)
    want = (params_sha(params), state_sha(opt.state_dict()))
    survivors = members[:2] + members[3:]
    for own in (ownership, Ownership.from_chunk_layout(layout.relayout(survivors), survivors)):
        assert {(p, s) for p, s, _ in train_sharded(config, own)} == {want}
    with pytest.raises(ConfigError, match="must be the layout's members"):
        Ownership.from_chunk_layout(layout, members[:3])


def test_windows_widen_to_aligned_offsets_and_merge() -> None:
    # tensors of 1000, 0 and 300 elements; rank 0 owns 0..130, 200..260, 1100..1120
    ranks = [[(0, 130), (200, 260), (1100, 1120)], [(130, 200), (260, 1100), (1120, 1300)]]
    own = owning((1000, 0, 300), ranks)
    assert windows(own, 0, {0, 1, 2}) == [
        Window(0, 0, 384, (Range(0, 130), Range(200, 260))),  # 0..256 and 128..384 merge
        Window(2, 0, 128, (Range(100, 120),)),
    ]
    assert windows(own, 1, {0, 1, 2}) == [
        Window(0, 128, 1000, (Range(130, 200), Range(260, 1000))),  # clipped at the end
        Window(1, 0, 0, ()),  # rank 1 owns element 1000, so it anchors the empty tensor
        Window(2, 0, 300, (Range(0, 100), Range(120, 300))),
    ]
    assert windows(own, 1, {2}, align=1) == [
        Window(2, 0, 100, (Range(0, 100),)),
        Window(2, 120, 300, (Range(120, 300),)),
    ]
    assert windows(own, 0, {0}, align=1) == [
        Window(0, 0, 130, (Range(0, 130),)),
        Window(0, 200, 260, (Range(200, 260),)),
    ]
    assert ALIGN % 64 == 0  # every vector loop stride divides it


# ---- bit identity, ranks on threads -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_supported_optimizer_matches_the_unsharded_step(name: str) -> None:
    config = CONFIGS[name]
    params, opt = reference(config)
    want = (params_sha(params), state_sha(opt.state_dict()))
    for ownership in (Ownership.balanced(sizes(), 3), chunked(4)):
        got = train_sharded(config, ownership)
        assert {(p, s) for p, s, _ in got} == {want}, f"{name} at W={ownership.world}"


@pytest.mark.parametrize("name", ["sgd-momentum-wd", "adam-wd", "adamw", "rmsprop"])
def test_bf16_parameters_match_the_unsharded_step(name: str) -> None:
    # bf16 is where the kernels' vector lanes and scalar tail round differently: the
    # windows keep every element on its unsharded path.
    config = CONFIGS[name]
    params, opt = reference(config, dtype=torch.bfloat16)
    want = (params_sha(params), state_sha(opt.state_dict()))
    for world in (2, 3):
        got = train_sharded(config, chunked(world, 61), torch.bfloat16)
        assert {(p, s) for p, s, _ in got} == {want}, f"{name} at W={world}"


def test_an_lr_scheduler_on_the_script_optimizer_drives_the_shard() -> None:
    config = CONFIGS["adamw"]

    def decay(step: int) -> float:
        return 0.5**step

    params = make_params()
    opt = make_optimizer(config, params)
    sched = OPT.lr_scheduler.LambdaLR(opt, decay)
    for step in range(STEPS):
        set_grads(params, step)
        opt.step()
        sched.step()
    want = (params_sha(params), state_sha(opt.state_dict()))

    def member(rank: int, gather: Any) -> tuple[str, str, list[dict[str, Any]]]:
        mine = make_params()
        front = make_optimizer(config, mine)
        sched = OPT.lr_scheduler.LambdaLR(front, decay)  # built on the script's optimizer
        zero = ZeroOptimizer(mine, front, Ownership.balanced(sizes(), 3), gather)
        for step in range(STEPS):
            set_grads(mine, step)
            zero.step()
            sched.step()  # no "lr_scheduler.step() before optimizer.step()" warning
        return params_sha(mine), state_sha(zero.full_state_dict()), zero.param_groups

    for p, s, groups in on_threads(3, member):
        assert (p, s) == want  # every step used the scheduled lr
        assert [g["lr"] for g in groups] == [g["lr"] for g in opt.param_groups]


def test_a_shard_snapshot_restores_and_the_step_repeats_identically() -> None:
    config = CONFIGS["adam-wd"]
    ownership = chunked(3, 113)

    def member(rank: int, gather: Any) -> tuple[str, str]:
        params = make_params()
        zero = ZeroOptimizer(params, make_optimizer(config, params), ownership, gather)
        for step in range(2):
            set_grads(params, step)
            zero.step()
        snap = zero.state_dict()
        # its owned pieces, and the empty tensor if it anchors it
        assert {tuple(pc) for pc in snap["pieces"]} - {(3, 0, 0)} == set(ownership.pieces(rank))
        saved = {i: {k: clone_value(v) for k, v in s.items()} for i, s in snap["state"].items()}
        snap = {**snap, "state": saved}
        kept = [p.detach().clone() for p in params]
        set_grads(params, 2)
        zero.step()
        first = params_sha(params), state_sha(zero.full_state_dict())
        with torch.no_grad():  # roll back: the snapshot's parameters and shard
            for p, k in zip(params, kept, strict=True):
                p.copy_(k)
        zero.load_state_dict(snap)
        set_grads(params, 2)
        zero.step()
        assert (params_sha(params), state_sha(zero.full_state_dict())) == first
        with pytest.raises(StateShapeError, match="another ownership needs load_full_state"):
            zero.load_state_dict({**snap, "pieces": [[0, 0, 1]]})
        return first

    params, opt = reference(config)
    want = (params_sha(params), state_sha(opt.state_dict()))
    assert set(on_threads(3, member)) == {want}


def test_full_state_reshards_to_another_world_size() -> None:
    """3 ranks train 2 steps; their gathered state (a durable checkpoint) resumes on 2
    ranks for the third step, as the unsharded optimizer would; and a script optimizer
    that already holds state hands it over at construction."""
    config = CONFIGS["sgd-momentum-wd"]
    ckpt: dict[str, Any] = {}

    def first(rank: int, gather: Any) -> None:
        params = make_params()
        zero = ZeroOptimizer(params, make_optimizer(config, params), chunked(3), gather)
        for step in range(2):
            set_grads(params, step)
            zero.step()
        full = zero.full_state_dict()
        if rank == 0:
            ckpt.update(params=[p.detach().clone() for p in params], optim=full)

    on_threads(3, first)
    _, ref_opt = reference(config, steps=2)
    assert state_sha(ckpt["optim"]) == state_sha(ref_opt.state_dict())

    def second(rank: int, gather: Any) -> tuple[str, str]:
        params = make_params()
        with torch.no_grad():
            for p, saved in zip(params, ckpt["params"], strict=True):
                p.copy_(saved)
        front = make_optimizer(config, params)
        if rank == 0:
            front.load_state_dict(ckpt["optim"])  # the script resumed its own optimizer
        zero = ZeroOptimizer(params, front, Ownership.balanced(sizes(), 2), gather)
        if rank == 1:
            zero.load_full_state_dict(ckpt["optim"])
        assert not front.state  # moved into the shard
        set_grads(params, 2)
        zero.step()
        return params_sha(params), state_sha(zero.full_state_dict())

    params, opt = reference(config)
    assert set(on_threads(2, second)) == {(params_sha(params), state_sha(opt.state_dict()))}


def test_optimizer_memory_per_rank_is_about_one_over_w() -> None:
    config = CONFIGS["adam-wd"]
    _, opt = reference(config)
    full = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    report = {}
    for world in (1, 2, 4):
        per_rank = [b for _, _, b in train_sharded(config, Ownership.balanced(sizes(), world))]
        report[world] = per_rank
        # scratch lanes: under 2 * ALIGN elements per window, two fp32 moments each
        slack = 2 * ALIGN * 8 * len(SHAPES)
        assert max(per_rank) <= full / world + slack, (world, per_rank, full)
    assert report[1] == [full]
    print(f"optimizer state bytes per rank: full {full}, sharded {report}")


# ---- refusals ---------------------------------------------------------------------------


class _MyAdam(OPT.Adam):
    pass


def test_what_cannot_be_sharded_is_refused_by_name() -> None:
    params = make_params()
    gather = LocalGathers(1).rank(0)
    own = Ownership.balanced(sizes(), 1)
    w = torch.nn.Parameter(torch.zeros(3))
    cases: list[tuple[Callable[[], torch.optim.Optimizer], str]] = [
        (lambda: OPT.LBFGS(params), "cannot shard LBFGS: it re-evaluates a closure"),
        (lambda: OPT.SparseAdam(params), "cannot shard SparseAdam: it steps sparse gradients"),
        (lambda: OPT.Adafactor(params), "cannot shard Adafactor: it factors the second moment"),
        (lambda: _MyAdam(params), "cannot shard _MyAdam: it subclasses Adam"),
        (lambda: OPT.Adam(params, differentiable=True), "Adam with differentiable=True"),
        (lambda: OPT.SGD([*params, w]), "SGD param group 0 holds a tensor of shape (3,)"),
    ]
    for build, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            ZeroOptimizer(params, build(), own, gather)
    hooked = OPT.Adam(params)
    hooked.register_step_post_hook(lambda *_: None)
    with pytest.raises(ConfigError, match=r"Adam has 1 step hook\(s\)"):
        ZeroOptimizer(params, hooked, own, gather)
    front = OPT.Adam(params)
    zero = ZeroOptimizer(params, front, own, gather)
    set_grads(params, 1)
    front.step()  # the script stepped its own optimizer: state outside the shard
    with pytest.raises(ConfigError, match="Adam holds state of its own"):
        zero.step()
    with pytest.raises(ConfigError, match="ownership has 2 ranks, the gather 1"):
        ZeroOptimizer(params, OPT.Adam(params), Ownership.balanced(sizes(), 2), gather)


def test_reduced_precision_with_several_threads_is_refused() -> None:
    # Over torch's grain (32768 elements) the unsharded step cuts a tensor between threads
    # at positions no window follows; bf16 rounds differently there.
    big = [torch.nn.Parameter(torch.zeros(40_000, dtype=torch.bfloat16))]
    one = LocalGathers(1).rank(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ConfigError, match="with 2 intra-op threads: torch cuts it"):
            ZeroOptimizer(big, OPT.Adam(big), owning((40_000,), [[(0, 40_000)]]), one)
        torch.set_num_threads(1)
        ZeroOptimizer(big, OPT.Adam(big), owning((40_000,), [[(0, 40_000)]]), one)
    finally:
        torch.set_num_threads(threads)


def test_a_payload_that_claims_what_its_rank_does_not_own_is_refused() -> None:
    params = make_params()
    own = Ownership.balanced(sizes(), 2)
    keys = frozenset({"exp_avg"})
    state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(185)}
    honest = pack_owned([Window(0, 0, 185, (Range(0, 185),))], [state], params, keys, CPU)
    big = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2100)}
    liar = pack_owned([Window(4, 0, 2100, (Range(0, 2100),))], [big], params, keys, CPU)
    with pytest.raises(
        BadMessage, match=re.escape("rank 1 sent tensor 0 elements 0..185, not its own")
    ):
        unpack_full([honest, honest], own, params, keys)
    with pytest.raises(BadMessage, match=re.escape("rank 0 sent tensor 4 elements 0..2100")):
        unpack_full([liar, honest], own, params, keys)
    not_json = torch.tensor([*(4).to_bytes(8, "little"), *b"nope"], dtype=torch.uint8)
    with pytest.raises(BadMessage, match="rank 0: header is not JSON"):
        unpack_full([not_json, honest], own, params, keys)


# ---- the real collective: W processes on gloo -------------------------------------------

GLOO_CONFIGS = ["sgd-momentum-wd", "adam-wd", "adamw"]  # the rest: on threads, above
WORLDS = (1, 2, 3, 4)
# ~20 s on an idle machine, past 100 s on a loaded one. A worker that runs past its limit
# writes every thread's stack to stderr and exits, so a stuck rank says where it was.
WORKER_LIMIT_S = 240


def _gloo_group(store: TCPStore, world: int, rank: int) -> Any:
    gloo: Any = torch.distributed.ProcessGroupGloo
    opts = gloo._Options()
    opts._devices = [gloo.create_device(hostname="127.0.0.1")]
    opts._timeout = TIMEOUT
    return gloo(PrefixStore(f"zero-test/w{world}/", store), rank, world, opts)


def _worker_main(port: int, rank: int) -> None:
    """Rank ``rank`` of the largest world; ranks 0..W-1 of it also form each smaller world,
    so four processes cover W = 1, 2, 3, 4."""
    faulthandler.dump_traceback_later(WORKER_LIMIT_S, exit=True)
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    for world in WORLDS:
        if rank >= world:
            continue
        # Rank 3 reaches W=4 while the others still run W=1..3: it waits for them here, not
        # inside gloo's connect (20 s: it gave up there on a loaded machine, and its peers
        # then found its port closed).
        store.set(f"zero-test/arrived/w{world}/{rank}", "1")
        peers = [f"zero-test/arrived/w{world}/{r}" for r in range(world)]
        store.wait(peers, timedelta(seconds=WORKER_LIMIT_S))
        gather = GroupGather(_gloo_group(store, world, rank))
        members = [f"n{r}/0" for r in range(world)]
        layout = Ownership.from_layout(make_layout(sizes(), members), members)
        runs = [(n, torch.float32, layout) for n in GLOO_CONFIGS]
        runs.append(("adamw", torch.bfloat16, chunked(world, 61)))
        for name, dtype, ownership in runs:
            params = make_params(dtype)
            opt = make_optimizer(CONFIGS[name], params)
            zero = ZeroOptimizer(params, opt, ownership, gather, timeout=TIMEOUT)
            for step in range(STEPS):
                set_grads(params, step)
                zero.step()
            full = zero.full_state_dict()
            key = f"{world}/{name}/{dtype}"
            results[key] = [params_sha(params), state_sha(full), zero.state_bytes()]
        # The all-to-all Muon's matrices travel by: rank r sends rank d r + d + 1 bytes.
        sends = [
            torch.full((rank + d + 1,), 16 * rank + d, dtype=torch.uint8) for d in range(world)
        ]
        got = [t.tolist() for t in gather.alltoall(sends, 2 * world, TIMEOUT)]
        assert got == [[16 * r + rank] * (r + rank + 1) for r in range(world)], got
        params = muon_case.muon_params()
        own = muon_case.chunked(world, 97)
        zero = ZeroOptimizer(params, muon_case.BUILDS["muon+adamw"](params), own, gather)
        for step in range(muon_case.STEPS):
            muon_case.muon_grads(params, step)
            zero.step()
        full = zero.full_state_dict()
        results[f"{world}/muon+adamw"] = [params_sha(params), state_sha(full), 0]
    print("RESULT " + json.dumps({"rank": rank, "results": results}), flush=True)


def _wait_all(procs: list[subprocess.Popen[bytes]], limit_s: float) -> None:
    """Wait for every process. Once one has failed the rest get 10 s, then are killed: each
    failed rank is shown, and the first to fail need not be rank 0 (a rank whose peer died
    fails to connect to it)."""
    deadline, grace = time.monotonic() + limit_s, None
    while time.monotonic() < deadline and None in (codes := [p.poll() for p in procs]):
        if grace is None and any(c not in (None, 0) for c in codes):
            grace = deadline = min(deadline, time.monotonic() + 10)
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(WORKER_LIMIT_S + 60)
def test_gloo_ranks_match_the_unsharded_step_at_every_world_size(tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outs = [(tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err") for r in range(max(WORLDS))]
    procs = []
    for rank, (out, err) in enumerate(outs):  # files, not pipes: nobody reads while they run
        with out.open("wb") as o, err.open("wb") as e:
            cmd = [sys.executable, __file__, str(store.port), str(rank)]
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e))
    try:  # the references, while the workers start
        want = {}
        for name, dtype in [(n, torch.float32) for n in GLOO_CONFIGS] + [("adamw", torch.bfloat16)]:
            params, opt = reference(CONFIGS[name], dtype=dtype)
            want[f"{name}/{dtype}"] = [params_sha(params), state_sha(opt.state_dict())]
        want["muon+adamw"] = list(muon_case.reference("muon+adamw"))
        _wait_all(procs, WORKER_LIMIT_S + 30)  # each worker ends itself first
        failed = [
            f"rank {rank} exit {proc.returncode}:\n{outs[rank][1].read_text()[-2000:]}"
            for rank, proc in enumerate(procs)
            if proc.returncode != 0
        ]
        assert not failed, "\n".join(failed)
        seen = set()
        for rank, (out, _) in enumerate(outs):
            lines = out.read_text().splitlines()
            line = next(x for x in lines if x.startswith("RESULT "))
            for key, (p, s, _) in json.loads(line[len("RESULT ") :])["results"].items():
                world, what = key.split("/", 1)
                assert [p, s] == want[what], f"{what} at W={world}, rank {rank}"
                seen.add(key)
        assert len(seen) == len(want) * len(WORLDS)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
