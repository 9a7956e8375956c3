"""`keepstep.device()`: GPU LOCAL_RANK when CUDA is there, else the CPU; a bad slot named."""

from __future__ import annotations

import os

import pytest
import torch

import keepstep
from keepstep.elastic.errors import ConfigError
from keepstep.elastic.local_device import device
from keepstep.elastic.rng import CUBLAS_WORKSPACE_CONFIG


def test_without_cuda_every_slot_trains_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device({}) == torch.device("cpu")
    assert device({"LOCAL_RANK": "3"}) == torch.device("cpu")
    assert keepstep.device is device


def test_with_cuda_the_slot_is_the_gpu_and_becomes_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert device({"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert device({}) == torch.device("cuda", 0)
    assert chosen == [1, 0]
    # set before CUDA starts, so that cuBLAS is deterministic when init checks it
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this process sees 2 CUDA device"):
        device({"LOCAL_RANK": "2"})


@pytest.mark.parametrize("raw", ["x", "-1", "1.5"])
def test_a_bad_local_rank_is_named(raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"LOCAL_RANK='{raw}' must be an int >= 0"):
        device({"LOCAL_RANK": raw})
