"""A loader worker's batch as bytes of a fixed layout (batch_wire.py): every collated shape
comes back exactly, and nothing but tensors and plain values is built."""

from __future__ import annotations

import pytest
import torch

from keepstep.elastic.batch_wire import BatchWireError, decode, encode


def test_a_collated_batch_comes_back_exactly() -> None:
    batch = {
        "input_ids": torch.arange(12).reshape(3, 4),
        "pixels": torch.randn(2, 3, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 5),
        "pair": (torch.tensor(1.5, dtype=torch.float64), [None, 2, float("inf"), "x"]),
        7: True,
    }
    back = decode(encode(batch))
    assert back.keys() == batch.keys() and isinstance(back["pair"], tuple)
    for name in ("input_ids", "pixels", "mask", "empty"):
        assert back[name].dtype == batch[name].dtype and torch.equal(back[name], batch[name])
    assert torch.equal(back["pair"][0], batch["pair"][0]) and back["pair"][1] == batch["pair"][1]
    assert back[7] is True


def test_what_cannot_travel_is_refused_and_bad_bytes_are_named() -> None:
    with pytest.raises(BatchWireError, match="holding a object cannot come back"):
        encode([object()])
    raw = encode((torch.ones(4),))
    with pytest.raises(BatchWireError, match="end early"):
        decode(raw[:-1])
    with pytest.raises(BatchWireError, match="not a batch encode wrote"):
        decode(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
