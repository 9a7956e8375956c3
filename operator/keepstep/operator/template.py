"""The pod hardening the operator applies, and the `spec.podTemplate` a TrainJob may lay over it.

Where it sits: `spec.JobSpec.from_dict` parses spec.podTemplate into a `PodTemplate` (checked:
messages name the field); `podspec.pod_manifest` builds the operator's pod and calls
`PodTemplate.apply` on it. Pure: no I/O.

The defaults pass Pod Security "restricted": the pod runs as non-root with the runtime's
seccomp profile and no service account token; the agent container may not escalate, drops
every capability and has a read-only root file system, with memory-backed /dev/shm (the
agents' snapshots) and an emptyDir at /tmp (the agent's run dir and the workers' temporary
files) to write to.

What a template may set, and how it merges: labels and annotations (added; keys under
keepstep.dev/ and app.kubernetes.io/managed-by are the operator's), securityContext and
containerSecurityContext (key by key over the defaults), volumes (by name: one named like a
default replaces it) and volumeMounts of the agent container (by mountPath), nodeSelector,
tolerations, serviceAccountName, automountServiceAccountToken, imagePullSecrets,
priorityClassName, schedulerName. The operator's invariants always win: the pod's name,
owner and job labels, the container's image, command, args, env and resources, restartPolicy,
subdomain and node affinity are not in the template's reach.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keepstep.operator.errors import SpecError

WHERE = "spec.podTemplate"
OWNED_KEY_PREFIXES = ("keepstep.dev/", "app.kubernetes.io/managed-by")
POD_SECURITY: Mapping[str, Any] = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: Mapping[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
SHM_VOLUME = "keepstep-shm"
VOLUMES: tuple[Mapping[str, Any], ...] = (
    {"name": "keepstep-tmp", "emptyDir": {}},
    {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
)
MOUNTS: tuple[Mapping[str, Any], ...] = (
    {"name": "keepstep-tmp", "mountPath": "/tmp"},
    {"name": "keepstep-shm", "mountPath": "/dev/shm"},
)
_SPEC_FIELDS = {
    "securityContext", "containerSecurityContext", "nodeSelector", "tolerations", "volumes",
    "volumeMounts", "serviceAccountName", "automountServiceAccountToken", "imagePullSecrets",
    "priorityClassName", "schedulerName",
}  # fmt: skip
_PASSED = {  # template field -> pod spec field, copied when set
    "nodeSelector": "nodeSelector",
    "tolerations": "tolerations",
    "serviceAccountName": "serviceAccountName",
    "imagePullSecrets": "imagePullSecrets",
    "priorityClassName": "priorityClassName",
    "schedulerName": "schedulerName",
}


def _object(raw: Any, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}={raw!r} must be an object")
    return raw


def _objects(raw: Any, where: str, key: str | None = None) -> tuple[Mapping[str, Any], ...]:
    """A list of objects; each needs a string `key` when one is named."""
    if raw is None:
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise SpecError(f"{where}={raw!r} must be a list")
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise SpecError(f"{where}[{i}]={item!r} must be an object")
        if key is not None and not (isinstance(item.get(key), str) and item[key]):
            raise SpecError(f"{where}[{i}].{key} is required (a non-empty string)")
    return tuple(raw)


def _strings(raw: Any, where: str) -> dict[str, str]:
    values = _object(raw, where)
    for k, v in values.items():
        if not isinstance(v, str):
            raise SpecError(f"{where}.{k}={v!r} must be a string")
    return dict(values)


def merge_by(
    base: Sequence[Mapping[str, Any]], extra: Sequence[Mapping[str, Any]], key: str
) -> list[dict[str, Any]]:
    """`base` with `extra` laid over it: an item of `extra` replaces the one of `base` with
    the same `key`, the others are appended in order."""
    out = {str(item[key]): copy.deepcopy(dict(item)) for item in base}
    for item in extra:
        out[str(item[key])] = copy.deepcopy(dict(item))
    return list(out.values())


@dataclass(frozen=True)
class PodTemplate:
    """spec.podTemplate, checked; empty when the job has none."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    spec: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Any) -> PodTemplate:
        top = _object(raw, WHERE)
        unknown = sorted(set(top) - {"metadata", "spec"})
        if unknown:
            raise SpecError(f"{WHERE}: unknown fields {unknown}; only metadata and spec")
        meta = _object(top.get("metadata"), f"{WHERE}.metadata")
        labels = _strings(meta.get("labels"), f"{WHERE}.metadata.labels")
        annotations = _strings(meta.get("annotations"), f"{WHERE}.metadata.annotations")
        for part, keys in (("labels", labels), ("annotations", annotations)):
            owned = sorted(k for k in keys if k.startswith(OWNED_KEY_PREFIXES))
            if owned:
                raise SpecError(
                    f"{WHERE}.metadata.{part}: {owned} belong to the operator "
                    "(keepstep.dev/*, app.kubernetes.io/managed-by)"
                )
        spec = dict(_object(top.get("spec"), f"{WHERE}.spec"))
        unknown = sorted(set(spec) - _SPEC_FIELDS)
        if unknown:
            allowed = ", ".join(sorted(_SPEC_FIELDS))
            raise SpecError(f"{WHERE}.spec: unknown fields {unknown}; allowed: {allowed}")
        template = cls(labels, annotations, spec)
        template._check()
        return template

    def _check(self) -> None:
        at = f"{WHERE}.spec"
        s = self.spec
        for name in ("securityContext", "containerSecurityContext", "nodeSelector"):
            _object(s.get(name), f"{at}.{name}")
        _strings(s.get("nodeSelector"), f"{at}.nodeSelector")
        _objects(s.get("tolerations"), f"{at}.tolerations")
        _objects(s.get("imagePullSecrets"), f"{at}.imagePullSecrets", "name")
        for name in ("serviceAccountName", "priorityClassName", "schedulerName"):
            if name in s and not (isinstance(s[name], str) and s[name]):
                raise SpecError(f"{at}.{name}={s[name]!r} must be a non-empty string")
        token = s.get("automountServiceAccountToken", False)
        if not isinstance(token, bool):
            raise SpecError(f"{at}.automountServiceAccountToken={token!r} must be true or false")
        volumes = _objects(s.get("volumes"), f"{at}.volumes", "name")
        for i, volume in enumerate(volumes):
            sources = sorted(set(volume) - {"name"})
            if len(sources) != 1:
                raise SpecError(
                    f"{at}.volumes[{i}] ({volume['name']}) must set exactly one volume source "
                    f"(emptyDir, persistentVolumeClaim, secret, ...), not {sources}"
                )
        names = {str(v["name"]) for v in merge_by(VOLUMES, volumes, "name")}
        mounts = _objects(s.get("volumeMounts"), f"{at}.volumeMounts", "mountPath")
        for i, mount in enumerate(mounts):
            if mount.get("name") not in names:
                raise SpecError(
                    f"{at}.volumeMounts[{i}].name={mount.get('name')!r} names no volume of the "
                    f"pod (volumes: {', '.join(sorted(names))})"
                )
        # What the kubelet checks at start: the agent's effective user against runAsNonRoot.
        pod = {**POD_SECURITY, **_object(s.get("securityContext"), "")}
        container = {**CONTAINER_SECURITY, **_object(s.get("containerSecurityContext"), "")}
        part = "containerSecurityContext" if "runAsUser" in container else "securityContext"
        user = container.get("runAsUser", pod.get("runAsUser"))
        if container.get("runAsNonRoot", pod.get("runAsNonRoot")) is True and user == 0:
            raise SpecError(
                f"{at}.{part}.runAsUser=0 contradicts runAsNonRoot=true (the operator's "
                "default): the kubelet would refuse to start the agent; set runAsNonRoot: "
                "false as well if the agent must run as root"
            )

    def apply(self, pod: dict[str, Any], shm_size_limit: str | None = None) -> dict[str, Any]:
        """The operator's `pod` (one agent container) hardened and with this template laid
        over it; the operator's own labels, container and identity are kept.
        `shm_size_limit`: the sizeLimit of the default /dev/shm volume (a template volume
        of that name replaces it whole)."""
        pod = copy.deepcopy(pod)
        meta, spec = pod["metadata"], pod["spec"]
        meta["labels"] = {**self.labels, **meta.get("labels", {})}
        if self.annotations:
            meta["annotations"] = {**self.annotations, **meta.get("annotations", {})}
        s = self.spec
        spec["securityContext"] = {**copy.deepcopy(POD_SECURITY), **s.get("securityContext", {})}
        spec["automountServiceAccountToken"] = bool(s.get("automountServiceAccountToken", False))
        for source, target in _PASSED.items():
            if source in s:
                spec[target] = copy.deepcopy(s[source])
        spec["volumes"] = merge_by(VOLUMES, s.get("volumes", ()), "name")
        own = {str(v["name"]) for v in s.get("volumes", ())}
        if shm_size_limit is not None and SHM_VOLUME not in own:
            for volume in spec["volumes"]:
                if volume["name"] == SHM_VOLUME:
                    volume["emptyDir"] = {**volume["emptyDir"], "sizeLimit": shm_size_limit}
        (container,) = spec["containers"]
        security = {**copy.deepcopy(CONTAINER_SECURITY), **s.get("containerSecurityContext", {})}
        container["securityContext"] = security
        container["volumeMounts"] = merge_by(MOUNTS, s.get("volumeMounts", ()), "mountPath")
        return pod
