"""The worker<->agent link's messages: every type survives JSON, anything else is refused
with an error that names the field."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from keepstep.agent.protocol.link import (
    AnswerBounds,
    BadFrame,
    Connection,
    Frame,
)
from keepstep.agent.protocol.messages import (
    AdmissionTimeout,
    AgentError,
    BadMessage,
    Boundary,
    Commit,
    ErrorCode,
    ErrorReply,
    Excluded,
    Failure,
    Finish,
    GatesPush,
    Hello,
    Hold,
    Initial,
    JobCannotContinue,
    MembershipReply,
    Message,
    NoChange,
    Ok,
    Op,
    PendingPush,
    Reconfigured,
    SlowDrain,
    decode,
    encode,
    error_of,
    error_reply,
)
from keepstep.errors import ConfigError

EVERY_TYPE: list[Message] = [
    Hello("n0/0"),
    Initial("n1/2"),
    Boundary("n0/0", 12),
    Failure("n0/0", 3, 41, "store 127.0.0.1:4 did not answer"),
    Finish("n0/0", 100, "ab" * 32),
    Commit(
        "n0/1",
        step=7,
        epoch=2,
        world_size=3,
        micro_batches=(1, 4),
        samples=(8, 9, 10, 11, 32, 33, 34, 35),
        step_s=0.25,
        assignment={"n0/0": (0, 3), "n0/1": (1, 4), "n1/0": (2, 5)},
        snapshot_s=0.01,
    ),
    Reconfigured(
        "n1/0",
        epoch=2,
        members=("n0/0", "n1/0"),
        communicator_s=0.1,
        restore_s=0.02,
        replan_s=0.0,
        resume_step=40,
        rolled_back_steps=1,
        received_state=True,
    ),
    SlowDrain("n1/0", epoch=2, step=30, ratio=0.1, reason="step 30: n1/0 ran at 0.100x"),
    MembershipReply(4, ("n0/0", "n2/0"), "127.0.0.1:2379"),
    MembershipReply(5, (), ""),  # the job ended while the worker waited
    MembershipReply(6, ("n0/0",), "10.0.0.1:2379", timeout_scale=4.0),  # after false alarms
    MembershipReply(7, ("n0/0",), "10.0.0.1:2379", token="0f" * 16),  # the epoch's key prefix
    Excluded(6),
    NoChange(),
    Ok(),
    ErrorReply(ErrorCode.ADMISSION_TIMEOUT, "n0/0 was not admitted within 1 s"),
    PendingPush(True),
    Hold("n1/0", 30),
    GatesPush((30, 45)),
    GatesPush(()),  # every gate is open
]


def test_every_op_has_a_message_in_the_round_trip_list() -> None:
    assert {m.OP for m in EVERY_TYPE} == set(Op)


@pytest.mark.parametrize("message", EVERY_TYPE, ids=lambda m: type(m).__name__)
def test_every_message_survives_json(message: Message) -> None:
    wire = json.loads(json.dumps(encode(message)))
    assert wire["op"] == message.OP.value
    back = decode(wire)
    assert back == message and type(back) is type(message)


def test_the_wire_form_is_flat_json() -> None:
    assert encode(Boundary("n0/0", 12)) == {"op": "boundary", "member": "n0/0", "done": 12}
    assert encode(PendingPush(False)) == {"op": "pending", "pending": False}
    commit = encode(EVERY_TYPE[5])
    assert commit["micro_batches"] == [1, 4] and commit["assignment"]["n1/0"] == [2, 5]


def test_a_field_with_a_default_may_be_left_out() -> None:
    wire = encode(EVERY_TYPE[5])
    del wire["snapshot_s"], wire["assignment"]
    back = decode(wire)
    assert isinstance(back, Commit) and back.snapshot_s == 0.0 and back.assignment == {}


def test_an_int_is_a_float_but_a_bool_is_no_number() -> None:
    wire = encode(EVERY_TYPE[5]) | {"step_s": 1}
    back = decode(wire)
    assert isinstance(back, Commit) and back.step_s == 1.0 and isinstance(back.step_s, float)
    refused(wire | {"step": True}, "step", "expected int, got bool True")


def refused(obj: Any, field: str | None, problem: str) -> BadMessage:
    with pytest.raises(BadMessage) as info:
        decode(obj)
    assert (info.value.field, info.value.problem) == (field, problem)
    if field is not None:
        assert field in str(info.value)
    return info.value


def test_unknown_and_missing_ops_are_refused() -> None:
    refused({"op": "reboot", "member": "n0/0"}, "op", "unknown operation 'reboot'")
    refused({"op": 3}, "op", "unknown operation 3")
    refused({"member": "n0/0"}, "op", "missing")
    refused(["hello"], None, "a link message is a JSON object, not list")


def test_a_missing_field_is_named() -> None:
    refused({"op": "boundary", "member": "n0/0"}, "done", "missing from 'boundary'")
    refused(
        {"op": "failure", "member": "n0/0", "epoch": 1, "done": 2},
        "reason",
        ("missing from 'failure'"),
    )


def test_an_unknown_field_is_named() -> None:
    refused({"op": "hello", "member": "n0/0", "rank": 0}, "rank", "not a field of 'hello'")


def test_a_value_of_the_wrong_type_is_named_down_to_the_element() -> None:
    refused(
        {"op": "boundary", "member": "n0/0", "done": "12"}, "done", ("expected int, got str '12'")
    )
    refused({"op": "hello", "member": None}, "member", "expected str, got NoneType None")
    members = {"op": "membership", "epoch": 1, "members": ["n0/0", 7], "store": ""}
    refused(members, "members[1]", "expected str, got int 7")
    refused(members | {"members": "n0/0"}, "members", "expected tuple[str, ...], got str 'n0/0'")
    wire = encode(EVERY_TYPE[5])
    wire["assignment"]["n1/0"] = [2, "5"]
    refused(wire, "assignment['n1/0'][1]", "expected int, got str '5'")
    refused({"op": "pending", "pending": 1}, "pending", "expected bool, got int 1")
    refused(
        {"op": "error", "code": "oops", "reason": ""},
        "code",
        ("'oops' is none of 'bad-request', 'admission-timeout', 'job-cannot-continue', 'failed'"),
    )


def test_errors_cross_the_link_as_their_types() -> None:
    for error, kind in [
        (AdmissionTimeout("not admitted within 1 s"), AdmissionTimeout),
        (JobCannotContinue("the job cannot continue: lost n1/0"), JobCannotContinue),
    ]:
        back = error_of(decode(json.loads(json.dumps(encode(error_reply(error))))))  # type: ignore[arg-type]
        assert type(back) is kind and str(back) == str(error)
    other = error_of(error_reply(KeyError("n9/0")))
    assert isinstance(other, AgentError) and other.code is ErrorCode.FAILED
    assert str(other) == "KeyError: 'n9/0'"
    bad = error_of(error_reply(BadMessage("done", "missing")))
    assert isinstance(bad, AgentError) and bad.code is ErrorCode.BAD_REQUEST


def test_the_framing_carries_the_request_id_and_refuses_bad_lines() -> None:
    left, right = socket.socketpair()
    a, b = Connection(left), Connection(right)
    try:
        a.send(Boundary("n0/0", 3), ident=17)
        a.send(PendingPush(True))
        assert b.receive() == Frame(Boundary("n0/0", 3), 17)
        assert b.receive() == Frame(PendingPush(True), None)
        left.sendall(b'{"op": "boundary", "id": 18, "member": "n0/0"}\n')
        with pytest.raises(BadFrame) as info:
            b.receive()
        assert (info.value.ident, info.value.field) == (18, "done")  # answerable by its id
        left.sendall(b"not json\n")
        with pytest.raises(BadFrame) as garbled:
            b.receive()
        assert garbled.value.ident is None
        a.send(Ok(), ident=19)
        assert b.receive() == Frame(Ok(), 19)  # the link goes on after a bad line
        a.close()
        assert b.receive() is None
    finally:
        b.close()


def test_answer_bounds_travel_in_the_environment() -> None:
    bounds = AnswerBounds(reply=3.0, decision=45.5, admission=7200.0)
    assert AnswerBounds.from_env(bounds.env()) == bounds
    assert AnswerBounds.from_env({}) == AnswerBounds()
    with pytest.raises(ConfigError, match="KEEPSTEP_DECISION_TIMEOUT='soon'"):
        AnswerBounds.from_env({"KEEPSTEP_DECISION_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match=r"AnswerBounds.admission=0\.0"):
        AnswerBounds(admission=0.0)
