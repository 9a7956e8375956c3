"""The snapshot meta's encoding: every plain value round-trips exactly, with its type;
anything that is not what `dumps` writes is refused, never turned into an object."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepstep.elastic import plain_json

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary()
# NaN is not equal to itself: as a key or a set member it cannot be compared back.
keys = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
hashable = st.recursive(
    keys | st.binary() | st.complex_numbers(allow_nan=False),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=8,
)
values = st.recursive(
    scalars | st.complex_numbers(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.sets(hashable, max_size=3)
        | st.frozensets(hashable, max_size=3)
        | st.dictionaries(hashable, inner, max_size=4)
    ),
    max_leaves=20,
)


def same(a: object, b: object) -> bool:
    """Equal with the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.isnan(a) and math.isnan(b) if a != a else a == b and repr(a) == repr(b)  # type: ignore[arg-type]
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)  # type: ignore[attr-defined]
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return same(list(a.items()), list(b.items()))  # type: ignore[attr-defined]
    return a == b or repr(a) == repr(b)


@given(values)
def test_every_plain_value_round_trips_with_its_types(value: object) -> None:
    assert same(plain_json.loads(plain_json.dumps(value)), value)


def test_the_values_a_snapshot_holds() -> None:
    meta = {
        "state": {0: {"step": 3.0, "betas": (0.9, 0.999)}},
        "groups": [{"params": [0, 1], "lr": 1e-3, "amsgrad": False, "weird": float("inf")}],
        "tracked": [["sched", ("V", {"last_epoch": 3, "_ids": {1, 2}})]],
        "raw": b"\x00\xff",
    }
    back = plain_json.loads(plain_json.dumps(meta))
    assert back == meta and isinstance(back["state"][0]["betas"], tuple)
    assert list(back["state"]) == [0]  # an int key stays an int


@pytest.mark.parametrize(
    "raw",
    [
        b"\x80\x04N.",  # a pickle
        b"{",
        b'{"x": 1}',  # no such tag
        b'{"d": 1, "t": 2}',  # two tags
        b'{"d": [[1]]}',
        b'{"d": [[[1], 1]]}',  # an unhashable key
        b'{"s": [[1]]}',
        b'{"b": "not base64!"}',
        b'{"c": ["1", 2]}',
        b"[" * 5000 + b"]" * 5000,  # deeper than anything meta holds
        b"\xff\xfe",
    ],
)
def test_anything_else_is_refused(raw: bytes) -> None:
    with pytest.raises(plain_json.PlainJSONError):
        plain_json.loads(raw)


def test_what_is_not_plain_is_refused_when_written() -> None:
    with pytest.raises(plain_json.PlainJSONError, match="object is not plain data"):
        plain_json.dumps({"x": object()})
    deep: list[object] = []
    for _ in range(plain_json.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(plain_json.PlainJSONError, match="deeper"):
        plain_json.dumps(deep)
