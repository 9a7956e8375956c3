"""ZeRO off the CPU: every tensor of the sharded step stays on the parameters' device.

A GPU is not needed to find a tensor put on the wrong device: PyTorch's "meta" device
stands in for one here. A meta tensor has a shape, a dtype and a device but no data, so
the sharded step runs its every operation on it, and any that mixes it with a CPU tensor
(a buffer allocated without ``device=``, a CPU scratch window, state loaded where it
arrived) fails as it would on a GPU. What it cannot show (the values) is checked on the
CPU by test_zero.py and test_zero_muon.py, and on a GPU by bench/gpu_check_zero.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from zero_scenario import TIMEOUT, on_threads

from keepstep.elastic.comm.rounds import Buffers, payload_sizes, same_device
from keepstep.elastic.errors import ConfigError
from keepstep.elastic.optimizer_group import OptimizerGroup
from keepstep.elastic.snapshot_pieces import pack_segments
from keepstep.elastic.snapshot_shard import PieceKey
from keepstep.elastic.zero import GroupGather, LocalGathers, Ownership, ZeroOptimizer
from keepstep.elastic.zero.gather import CommGather
from keepstep.elastic.zero.replicas import ReplicaSteps

META = torch.device("meta")
SHAPES: list[tuple[int, ...]] = [(37, 5), (300,), (64, 48), (1,), (700, 3), ()]
MATRICES = [0, 2, 4]


def _params(device: torch.device | str) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(s, device=device)) for s in SHAPES]


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    rest = [p for i, p in enumerate(params) if i not in MATRICES]
    muon = torch.optim.Muon([params[i] for i in MATRICES], lr=0.02)
    return OptimizerGroup([muon, torch.optim.AdamW(rest, lr=1e-3)])


def _state_devices(optimizer: torch.optim.Optimizer, keys: frozenset[str]) -> set[str]:
    """Where the per-element values of ``optimizer``'s state live."""
    return {
        v.device.type
        for state in optimizer.state.values()
        for k, v in state.items()
        if k in keys and isinstance(v, torch.Tensor)
    }


@pytest.mark.parametrize("kind", ["adamw", "sgd", "muon+adamw"])
@pytest.mark.parametrize("world", [1, 3])
def test_the_sharded_step_runs_on_the_parameters_device(kind: str, world: int) -> None:
    def member(rank: int, gather: Any) -> tuple[set[str], set[str]]:
        params = _params(META)
        sizes = [p.numel() for p in params]
        ownership = Ownership.balanced(sizes, world)
        zero = ZeroOptimizer(params, _optimizer(kind, params), ownership, gather, timeout=TIMEOUT)
        for _ in range(2):  # the second step reads the state the first made
            for p in params:
                p.grad = torch.zeros(p.shape, device=META)
            zero.step()
        pieces = zero.state_dict()["state"].values()
        held = {v.device.type for s in pieces for v in s.values() if isinstance(v, torch.Tensor)}
        keys = frozenset({"exp_avg", "exp_avg_sq", "momentum_buffer"})
        return _state_devices(zero.inner, keys), held

    for inner, held in on_threads(world, member, META):
        assert inner == {"meta"}, kind
        assert "meta" in held, kind  # the pieces a snapshot takes: not copied to the host


def test_replicas_arriving_on_the_cpu_are_stepped_on_the_parameters_device() -> None:
    params = _params(META)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    # As fetched from a peer or a snapshot: host tensors, a CPU step count.
    pieces = {
        PieceKey(1, 0, 100): {
            "step": torch.tensor(3.0),
            "exp_avg": torch.ones(100),
            "exp_avg_sq": torch.ones(100),
        },
        PieceKey(4, 64, 700): {
            "step": torch.tensor(3.0),
            "exp_avg": torch.ones(636),
            "exp_avg_sq": torch.ones(636),
        },
    }
    replicas = ReplicaSteps(optimizer, pieces, frozenset({"exp_avg", "exp_avg_sq"}))
    for p in params:
        p.grad = torch.zeros(p.shape, device=META)
    replicas.step()
    for state in replicas.inner.state.values():
        assert state["exp_avg"].device == META and state["exp_avg_sq"].device == META
        assert state["step"].device.type == "cpu"  # torch's rule for a non-fused step count
    out = replicas.pieces()
    assert set(out) == set(pieces)
    assert all(v["exp_avg"].device == META for v in out.values())


def test_segments_of_device_state_stay_on_the_device() -> None:
    state = {PieceKey(0, 0, 8): {"step": 2.0, "exp_avg": torch.zeros(8, device=META)}}
    head, *values = pack_segments(state)
    assert head.device.type == "cpu"  # the header, written here
    assert [v.device for v in values] == [META]  # the snapshot copies it off the step's path


def test_the_gathers_live_on_their_device_and_refuse_another() -> None:
    hub = LocalGathers(1, META)
    gather = hub.rank(0)
    assert gather.device == META
    got = gather.allgather(torch.zeros(4, device=META), timedelta(seconds=5))
    assert got[0].device == META
    with pytest.raises(ConfigError, match=r"on meta, got cpu"):
        gather.allgather(torch.zeros(4), timedelta(seconds=5))

    class _Group:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 1

    assert GroupGather(_Group()).device == torch.device("cpu")
    on_meta = GroupGather(_Group(), device="meta")
    assert on_meta.allgather(torch.zeros(2, device=META), timedelta(seconds=5))[0].device == META

    class _Comm:
        rank, size, members, device = 0, 1, ("a",), META

    assert CommGather(_Comm()).device == META  # type: ignore[arg-type]


def test_payloads_must_share_the_cpu_or_the_communicators_device() -> None:
    cpu = [torch.zeros(3, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)]
    assert payload_sizes(cpu, 2, META) == ([3, 0], torch.device("cpu"))
    on = [t.to(META) for t in cpu]
    assert payload_sizes(on, 2, META) == ([3, 0], META)
    with pytest.raises(ConfigError, match=r"on cpu, meta: they must all be on the CPU or all"):
        payload_sizes([cpu[0], on[1]], 2, META)
    with pytest.raises(ConfigError, match=r"all on the communicator's device \(cpu\)"):
        payload_sizes(on, 2, torch.device("cpu"))


def test_a_kept_buffer_lives_on_the_device_it_is_asked_for() -> None:
    buffers = Buffers()
    on_meta = buffers.alloc("recv", "meta")
    assert on_meta(16).device == META
    assert buffers.alloc("recv")(16).device.type == "cpu"  # asked elsewhere: made again
    assert same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), META)


def test_reduced_precision_off_the_cpu_is_not_held_to_the_cpus_thread_rule() -> None:
    # On the CPU, torch cuts a large bf16 tensor between intra-op threads where no window
    # follows (test_zero.py refuses it); a GPU's elementwise kernels do not: taken.
    big = [torch.nn.Parameter(torch.zeros(40_000, dtype=torch.bfloat16, device=META))]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = LocalGathers(1, META).rank(0)
        zero = ZeroOptimizer(big, torch.optim.Adam(big), Ownership.balanced([40_000], 1), one)
        assert zero.ownership.world == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [1, 3])
def test_zero2s_clip_and_gather_run_on_the_parameters_device(world: int) -> None:
    # ZeRO-2: the windows' gradients clipped where they lie (each tensor's norm taken on
    # its device, as torch's clip takes it), then gathered whole (for hooks).
    def member(rank: int, gather: Any) -> tuple[str, set[str]]:
        params = _params(META)
        sizes = [p.numel() for p in params]
        opt = torch.optim.SGD(params, lr=0.1)
        zero = ZeroOptimizer(params, opt, Ownership.balanced(sizes, world), gather, timeout=TIMEOUT)
        grads = [torch.zeros(w.stop - w.start, device=META) for w in zero.windows]
        zero.attach_grads(grads, [1] * len(params))
        total = zero.clip_attached(1.0)
        zero.gather_grads(grads, [1] * len(params))
        return total.device.type, {p.grad.device.type for p in params if p.grad is not None}

    for total, grads in on_threads(world, member, META):
        assert total == "meta" and grads == {"meta"}
