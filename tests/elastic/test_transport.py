"""Tests of the communicator's transport seam (keepstep.elastic.comm.transport): the choice
of backend, the tensor checks, and the shared epoch logic over a fake wedged transport."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, Store

from keepstep.elastic.comm import Backend, Communicator, abort_epoch, select_backend
from keepstep.elastic.comm.group import EpochSpec
from keepstep.elastic.comm.transport import Link, Pending, check_dense
from keepstep.elastic.comm.watch import AbortWatch
from keepstep.elastic.errors import ConfigError, PeerLost

_WAIT_S = 10.0  # bound of every wait in these tests; none is expected to take long


def test_the_backend_follows_the_device_unless_named() -> None:
    assert select_backend(None, None) is Backend.GLOO
    assert select_backend("cpu", None) is Backend.GLOO
    assert select_backend(torch.device("cuda", 1), None) is Backend.NCCL
    assert select_backend("cuda", "nccl") is Backend.NCCL
    assert select_backend("cpu", Backend.GLOO) is Backend.GLOO


@pytest.mark.parametrize(
    ("device", "backend", "message"),
    [
        ("cuda:0", "gloo", "backend gloo takes cpu tensors, but the device is 'cuda'"),
        ("cpu", "nccl", "backend nccl takes cuda tensors, but the device is 'cpu'"),
        ("cpu", "mpi", "backend must be one of ['gloo', 'nccl'], got 'mpi'"),
        ("meta", None, "device must be 'cpu' or 'cuda[:N]', got 'meta'"),
        ("gpu", None, "device must be 'cpu' or 'cuda[:N]', got 'gpu'"),
    ],
)
def test_a_backend_that_does_not_suit_the_device_is_refused(
    device: str, backend: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        select_backend(device, backend)


def test_the_dense_check_names_what_is_wrong() -> None:
    cpu = torch.device("cpu")
    check_dense(torch.zeros(3), "allreduce", cpu)
    with pytest.raises(
        ConfigError, match=re.escape("needs a dense CPU tensor, got torch.strided on meta")
    ):
        check_dense(torch.zeros(3, device="meta"), "allreduce", cpu)
    with pytest.raises(
        ConfigError, match=re.escape("needs a dense cuda:0 tensor, got torch.strided on cpu")
    ):
        check_dense(torch.zeros(3), "broadcast", torch.device("cuda", 0))
    with pytest.raises(
        ConfigError, match=re.escape("needs a dense CPU tensor, got torch.sparse_coo")
    ):
        check_dense(torch.zeros(3).to_sparse(), "allreduce", cpu)
    with pytest.raises(ConfigError, match="contiguous"):
        check_dense(torch.zeros(2, 2).t(), "allreduce", cpu)
    with pytest.raises(ConfigError, match=re.escape("needs a torch.Tensor, got list")):
        check_dense([1.0], "allreduce", cpu)  # type: ignore[arg-type]


def test_a_cuda_communicator_refuses_cpu_tensors_and_needs_a_gpu_to_connect() -> None:
    solo = Communicator.create(HashStore(), 0, ["a"], "a", device="cuda:0")
    assert (solo.backend, solo.device) == (Backend.NCCL, torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="allreduce needs a dense cuda:0 tensor"):
        solo.allreduce(torch.zeros(2))
    solo.close()
    gloo = Communicator.create(HashStore(), 0, ["a"], "a")
    assert (gloo.backend, gloo.device) == (Backend.GLOO, torch.device("cpu"))
    gloo.close()
    if not torch.cuda.is_available():
        with pytest.raises(PeerLost, match="the NCCL transport needs a CUDA device"):
            Communicator.create(
                HashStore(), 0, ["a", "b"], "a", timedelta(seconds=5), device="cuda:0"
            )


def test_a_watch_runs_its_abort_hooks_once_on_the_thread_that_heard_it() -> None:
    store = HashStore()
    watch = AbortWatch(store, 4, 0, 2)
    ran: list[str] = []
    heard = threading.Event()

    def hook() -> None:
        ran.append(threading.current_thread().name)
        heard.set()

    watch.when_aborted(hook)
    assert ran == []
    abort_epoch(store, 4, "agent: b is gone", 2)
    assert heard.wait(_WAIT_S)
    assert watch.check(fresh=True) == "agent: b is gone"
    late: list[str] = []
    watch.when_aborted(lambda: late.append(threading.current_thread().name))
    assert late == [threading.current_thread().name]  # already aborted: at once, here
    watch.close()
    assert watch.listened.wait(_WAIT_S)
    assert len(ran) == 1
    assert ran[0].startswith("keepstep-abort")  # the listener (or reader), not the caller


# ---- a fake wedged transport --------------------------------------------------------------


class _WedgedPending:
    """A collective whose wait never returns until interrupted (a CUDA sync on a dead peer),
    and whose work then goes on writing its buffer until ``finish``."""

    def __init__(self, link: _WedgedLink, tensor: torch.Tensor) -> None:
        self.link = link
        self.tensor = tensor
        self.slices = 0
        self.finished = threading.Event()

    def ready(self, slice_ms: int) -> bool:
        self.slices += 1
        self.link.blocked.set()
        # Ignores slice_ms: blocked where no slice ends.
        return self.link.interrupted.wait(_WAIT_S)

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def result(self) -> None:
        raise RuntimeError("NCCL communicator was aborted")

    def finish(self, value: float) -> None:
        self.tensor.fill_(value)  # the peer came back: the work writes, after PeerLost
        self.finished.set()


class _WedgedLink:
    def __init__(self) -> None:
        self.interrupted = threading.Event()
        self.blocked = threading.Event()  # a collective's wait has begun
        self.interrupted_by: list[str] = []
        self.started: list[_WedgedPending] = []
        self.retired: list[Pending | None] = []
        self.held: list[Pending] = []

    @property
    def raw(self) -> object:
        return self

    def allreduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, timeout: timedelta
    ) -> Pending:
        pending = _WedgedPending(self, tensor)
        self.started.append(pending)
        return pending

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: timedelta) -> Pending:
        return self.allreduce(tensor, dist.ReduceOp.SUM, timeout)

    def allgather(
        self, slots: list[torch.Tensor], mine: torch.Tensor, timeout: timedelta
    ) -> Pending:
        return self.allreduce(mine, dist.ReduceOp.SUM, timeout)

    def barrier(self, timeout: timedelta) -> Pending:
        return self.allreduce(torch.zeros(1), dist.ReduceOp.SUM, timeout)

    def interrupt(self) -> None:
        self.interrupted_by.append(threading.current_thread().name)
        self.interrupted.set()

    def retire(self, pending: Pending | None) -> None:
        self.retired.append(pending)
        if pending is not None and not pending.is_completed():
            self.held.append(pending)  # a real link keeps it until it is over


class _WedgedTransport:
    def __init__(self) -> None:
        self.links: list[_WedgedLink] = []

    @property
    def backend(self) -> Backend:
        return Backend.NCCL

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        check_dense(tensor, what, torch.device("cpu"))

    def connect(self, store: Store, spec: EpochSpec) -> Link:
        link = _WedgedLink()
        self.links.append(link)
        return link


def test_the_listener_interrupts_a_main_thread_blocked_where_no_slice_ends() -> None:
    store = HashStore()
    transport = _WedgedTransport()
    comm = Communicator.over(transport, store, 0, ["a", "b"], "a", timedelta(seconds=60))
    (link,) = transport.links
    buffer = torch.ones(4)

    def abort_once_blocked() -> None:
        assert link.blocked.wait(_WAIT_S)
        abort_epoch(store, 0, "agent: b lost its lease", 2)

    aborter = threading.Thread(target=abort_once_blocked)
    aborter.start()
    with pytest.raises(PeerLost, match="b lost its lease"):
        comm.allreduce(buffer)
    aborter.join(_WAIT_S)
    (pending,) = link.started
    # The wait never came back to look at the abort key: the listener's interrupt ended it.
    assert pending.slices == 1
    assert len(link.interrupted_by) == 1
    assert link.interrupted_by[0].startswith("keepstep-abort")
    # The given-up work was handed to the link, which holds its buffer until it is over.
    assert link.retired == [pending]
    assert link.held == [pending] and pending.tensor is buffer
    pending.finish(7.0)  # written after PeerLost: why the caller takes a fresh buffer
    assert buffer.tolist() == [7.0] * 4
    with pytest.raises(PeerLost, match="b lost its lease"):  # latched
        comm.barrier()
    comm.close()
    assert link.retired == [pending]  # retired once


def test_close_retires_the_link_with_the_work_in_flight() -> None:
    store = HashStore()
    transport = _WedgedTransport()
    comm = Communicator.over(transport, store, 2, ["a", "b"], "a", timedelta(seconds=60))
    (link,) = transport.links

    def close_once_blocked() -> None:
        assert link.blocked.wait(_WAIT_S)
        comm.close()
        link.interrupt()  # what the link's owner does once retired: the wait ends

    closer = threading.Thread(target=close_once_blocked)
    closer.start()
    with pytest.raises(PeerLost, match="communicator closed"):
        comm.allreduce(torch.zeros(2))
    closer.join(_WAIT_S)
    assert link.retired == link.started  # the work in flight went with the link
