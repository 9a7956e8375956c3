"""Tests of keepstep.elastic.numerics: the fingerprint is validated, its digest stable and
round-trippable, and exact mode refuses to mix fingerprints with an error naming both."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from keepstep.elastic.errors import BadMessage, ConfigError
from keepstep.elastic.numerics import (
    NumericsFingerprint,
    NumericsMismatch,
    agree,
    check_agreement,
    current,
    mixed_reason,
    model_kernels,
)
from keepstep.elastic.reduce import ReduceMode

H200 = NumericsFingerprint(
    device_kind="cuda",
    device_name="NVIDIA H200",
    capability="9.0",
    sm_count=132,
    driver="13.0",
    cuda="13.0",
    cublas="13.1.0.3",
    cudnn="91300",
    torch="2.11.0+cu130",
)


def test_the_digest_is_stable_and_covers_every_field() -> None:
    assert H200.digest == dataclasses.replace(H200).digest
    assert len(H200.digest) == 16 and int(H200.digest, 16) >= 0
    changed = {
        "device_name": "NVIDIA H100 80GB HBM3",
        "capability": "8.0",
        "sm_count": 114,
        "driver": "12.8",
        "cuda": "12.8",
        "cublas": "12.8.4.1",
        "cudnn": "90800",
        "torch": "2.11.0+cu128",
        "kernels": "compiled",
    }
    digests = {dataclasses.replace(H200, **{k: v}).digest for k, v in changed.items()}
    assert len(digests | {H200.digest}) == len(changed) + 1


def test_the_digest_is_the_same_in_another_process() -> None:
    code = (
        "from keepstep.elastic.numerics import NumericsFingerprint as F\n"
        f"print(F.from_dict({H200.as_dict()!r}).digest)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split()[-1] == H200.digest


def test_round_trip_through_a_record() -> None:
    assert NumericsFingerprint.from_dict(H200.as_dict()) == H200
    with pytest.raises(ConfigError, match=r"fingerprint keys .*; expected"):
        NumericsFingerprint.from_dict({**H200.as_dict(), "extra": "x"})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sm_count": -1}, r"sm_count=-1 must be an int >= 0"),
        ({"sm_count": True}, r"sm_count=True must be an int >= 0"),
        ({"driver": ""}, r"driver='' must be a non-empty str"),
        ({"torch": 2}, r"torch=2 must be a non-empty str"),
        ({"device_kind": "tpu"}, r"device_kind='tpu'; allowed: 'cuda', 'cpu'"),
    ],
)
def test_bad_fields_are_named(change: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(H200, **change)  # type: ignore[arg-type]


def test_equal_fingerprints_agree_in_both_modes() -> None:
    same = {"node-a": H200, "node-b": dataclasses.replace(H200)}
    assert mixed_reason(same) is None and mixed_reason({}) is None
    assert check_agreement(same, ReduceMode.EXACT) is None
    assert check_agreement(same, ReduceMode.FAST) is None


def test_exact_mode_refuses_a_mix_naming_both() -> None:
    h100 = dataclasses.replace(H200, device_name="NVIDIA H100 80GB HBM3", sm_count=132)
    members = {"node-b": h100, "node-a": H200, "node-c": H200}
    with pytest.raises(NumericsMismatch) as caught:
        check_agreement(members, ReduceMode.EXACT)
    text = str(caught.value)
    assert "node-a" in text and "node-b" in text and "node-c" not in text
    assert "NVIDIA H200" in text and "NVIDIA H100 80GB HBM3" in text
    assert H200.digest in text and h100.digest in text
    assert "(2 fingerprints; device_name)" in text
    # Fast mode runs on, with the reason to log.
    reason = check_agreement(members, ReduceMode.FAST)
    assert reason is not None and "device_name" in reason


def test_this_process_has_a_valid_fingerprint() -> None:
    cpu = current(torch.device("cpu"))
    assert cpu.device_kind == "cpu" and cpu.sm_count == 0
    assert cpu.torch == torch.__version__
    assert cpu == current(torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"device=meta"):
        current(torch.device("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: reads the GPU")
def test_a_cuda_fingerprint_names_the_gpu() -> None:
    fp = current(torch.device("cuda"))
    assert fp.device_kind == "cuda" and fp.sm_count > 0
    assert fp.device_name == torch.cuda.get_device_name()


def test_agree_reads_what_members_told_and_names_a_malformed_one() -> None:
    told = {"node-a": H200.as_dict(), "node-b": H200.as_dict(), "old": None}
    assert agree(told, ReduceMode.EXACT) is None
    other = dataclasses.replace(H200, driver="12.8").as_dict()
    with pytest.raises(NumericsMismatch, match=r"node-a has .* node-b has .*driver 12\.8"):
        agree({"node-a": H200.as_dict(), "node-b": other}, ReduceMode.EXACT)
    assert "driver" in (agree({"node-a": H200.as_dict(), "node-b": other}, ReduceMode.FAST) or "")
    with pytest.raises(BadMessage, match=r"node-b's numerics fingerprint: fingerprint keys"):
        agree({"node-a": H200.as_dict(), "node-b": {"torch": "2"}}, ReduceMode.EXACT)
    with pytest.raises(BadMessage, match=r"node-b's numerics fingerprint: sm_count="):
        agree({"node-b": {**H200.as_dict(), "sm_count": "many"}}, ReduceMode.EXACT)


def test_the_models_kernels_are_told_apart() -> None:
    """A member that compiles (all of the model, or some modules) and one that does not
    compute different bits: the fingerprint says which, without compiling anything."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    assert model_kernels(model) == "eager"
    assert model_kernels(torch.compile(model)) == "compiled"
    assert model_kernels(model) == "eager"  # the wrapper leaves the model as it was
    model[0].compile()
    assert model_kernels(model) == "compiled in part (1 of 4 modules)"
    model.compile()
    assert model_kernels(model) == "compiled"
    eager, compiled = (current(torch.device("cpu"), k) for k in ("eager", "compiled"))
    assert eager.kernels == "eager" and compiled.describe().endswith(", compiled model")
    with pytest.raises(NumericsMismatch, match=r"\(2 fingerprints; kernels\): a has .*eager model"):
        check_agreement({"a": eager, "b": compiled}, ReduceMode.EXACT)
