"""A node's leased registration against a real etcd: renewing after the lease expired.

When a stopped node is continued, its lease has expired; the worker asking to be admitted
again (a write under the lease) and the agent's watch (its record deleted) both notice,
in either order. The first renews; the second must keep what the first made.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from keepstep.agent.kv.etcd import EtcdKV
from keepstep.agent.node.registration import Registration
from keepstep.agent.protocol import NodeRecord


@pytest.fixture
def kv(etcd_server: str) -> Iterator[EtcdKV]:
    client = EtcdKV(etcd_server, timeout=5.0)
    yield client
    client.close()


def registration(kv: EtcdKV) -> tuple[Registration, str]:
    prefix = f"/test-registration/{uuid.uuid4().hex}/"
    record = NodeRecord("n1", "127.0.0.1", 1, 1)
    reg = Registration(kv, prefix + "nodes/n1", 1.0, 5.0, lambda: record)
    reg.register()
    return reg, prefix


def test_a_write_after_the_lease_expired_registers_again_and_lands(kv: EtcdKV) -> None:
    reg, prefix = registration(kv)
    old = reg.lease
    assert old is not None
    old.revoke()  # what an expiry leaves: no lease, no record
    assert kv.get(reg.key, 5.0) is None

    reg.put(prefix + "pending/n1-0", b"pending")
    assert reg.lease is not None and reg.lease.id != old.id
    assert kv.get(prefix + "pending/n1-0", 5.0) is not None
    assert kv.get(reg.key, 5.0) is not None  # registered again

    # The watch sees the old record's deletion afterwards: the new lease stays, and with
    # it the pending record written under it.
    new = reg.lease
    reg.renew()
    assert reg.lease is new
    time.sleep(2.5)  # past the 1 s TTL: the new lease is kept alive
    assert kv.get(prefix + "pending/n1-0", 5.0) is not None
    assert kv.get(reg.key, 5.0) is not None
    reg.stop()


def test_a_write_that_saw_an_older_lease_go_keeps_the_current_one(kv: EtcdKV) -> None:
    reg, _ = registration(kv)
    old = reg.lease
    assert old is not None
    old.revoke()
    reg.renew()  # the watch renewed first
    current = reg.lease
    assert current is not None and current.id != old.id
    reg.renew(lost=old)  # then the refused write asks
    assert reg.lease is current
    reg.stop()


def test_a_deleted_record_under_a_live_lease_is_written_again(kv: EtcdKV) -> None:
    reg, _ = registration(kv)
    lease = reg.lease
    kv.delete(reg.key, 5.0)
    reg.renew()
    assert reg.lease is lease
    got = kv.get(reg.key, 5.0)
    assert got is not None
    reg.stop()


def test_a_closed_registration_does_not_register_again(kv: EtcdKV) -> None:
    reg, _ = registration(kv)
    lease = reg.lease
    assert lease is not None
    reg.stop()
    lease.revoke()
    reg.renew()
    assert reg.lease is lease and kv.get(reg.key, 5.0) is None
