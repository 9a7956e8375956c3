"""etcd users and roles: one per job, allowed its own key prefix and nothing else.

Where it sits: whoever runs the job etcd calls these with a root client: `keepstep run`
for its private etcd, the operator for the cluster's. `enable_auth` turns etcd's auth on
(creating the root user first, as etcd requires); `grant_job` gives a job a role with
read-write access to `/keepstep/jobs/<job>/` and a user of the same name; `revoke_job`
deletes both, which ends the job's access at once (its certificate then names no user).
Clients authenticate by certificate (`etcd_pki`): etcd maps the certificate's common name
to the user, so the passwords set here are random, never stored and never used.

Every call is idempotent, so a retried reconcile or a second launcher call does no harm.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

from pyetcd import etcdrpc

from keepstep.agent.kv import KVError
from keepstep.agent.kv.etcd import EtcdKV, range_end
from keepstep.agent.protocol import job_prefix
from keepstep.errors import ConfigError

__all__ = ["ROOT_USER", "enable_auth", "grant_job", "job_user", "revoke_job"]

ROOT_USER = "root"
_USER_PREFIX = "keepstep-job:"
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,399}$")
_MAX_NAME = 64  # a certificate's common name (X.509's upper bound)


def job_user(job: str) -> str:
    """The etcd user and role of `job` (also its client certificate's common name):
    "keepstep-job:<job>", or, for a job name too long for a common name, its first
    characters, "~" and 24 hex digits of its SHA-256 (unique, still recognisable)."""
    if not _JOB.match(job):
        raise ConfigError(f"job {job!r} must be 1..400 of A-Z a-z 0-9 . _ - (no leading . _ -)")
    name = _USER_PREFIX + job
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(job.encode()).hexdigest()[:24]
    keep = _MAX_NAME - len(_USER_PREFIX) - len(digest) - 1
    return f"{_USER_PREFIX}{job[:keep]}~{digest}"


def enable_auth(kv: EtcdKV, timeout: float | None = None) -> None:
    """Create the root user (with the root role) if missing and enable auth."""
    auth = _stub(kv)
    _tolerate(
        kv, "add user root", auth.UserAdd, _user(ROOT_USER), timeout, "user name already exists"
    )
    grant = etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_USER)
    kv.call("grant root the root role", auth.UserGrantRole, grant, timeout)
    kv.call("enable auth", auth.AuthEnable, etcdrpc.AuthEnableRequest(), timeout)


def grant_job(kv: EtcdKV, job: str, timeout: float | None = None) -> str:
    """Give `job` a user and a role that may read and write its prefix only; return the
    user's name (the common name its client certificate must carry)."""
    user = job_user(job)
    prefix = job_prefix(job).encode()
    auth = _stub(kv)
    _tolerate(
        kv,
        f"add role {user}",
        auth.RoleAdd,
        etcdrpc.AuthRoleAddRequest(name=user),
        timeout,
        "role name already exists",
    )
    permission = etcdrpc.Permission(
        permType=etcdrpc.Permission.READWRITE, key=prefix, range_end=range_end(prefix)
    )
    request = etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=permission)
    kv.call(f"grant {user} its prefix", auth.RoleGrantPermission, request, timeout)
    _tolerate(kv, f"add user {user}", auth.UserAdd, _user(user), timeout, "already exists")
    request = etcdrpc.AuthUserGrantRoleRequest(user=user, role=user)
    kv.call(f"grant user {user} its role", auth.UserGrantRole, request, timeout)
    return user


def revoke_job(kv: EtcdKV, job: str, timeout: float | None = None) -> None:
    """Delete the job's user and role (missing ones are fine)."""
    user = job_user(job)
    auth = _stub(kv)
    request: Any = etcdrpc.AuthUserDeleteRequest(name=user)
    _tolerate(kv, f"delete user {user}", auth.UserDelete, request, timeout, "not found")
    request = etcdrpc.AuthRoleDeleteRequest(role=user)
    _tolerate(kv, f"delete role {user}", auth.RoleDelete, request, timeout, "not found")


def _stub(kv: EtcdKV) -> Any:
    if not kv.secure:
        raise ConfigError(
            f"etcd at {kv.endpoint}: auth needs a TLS client (certificates name the users)"
        )
    return etcdrpc.AuthStub(kv.channel())


def _user(name: str) -> Any:
    return etcdrpc.AuthUserAddRequest(name=name, password=secrets.token_urlsafe(24))


def _tolerate(
    kv: EtcdKV, what: str, method: Any, request: Any, timeout: float | None, benign: str
) -> None:
    """Make the call; an answer that says it was already done (`benign`) is success."""
    try:
        kv.call(what, method, request, timeout)
    except KVError as err:
        if benign not in str(err):
            raise
