"""Field checks of a TrainJob spec that need more than a type: env names and sources,
resource quantities, the checkpoint URL's scheme.

Where it sits: `spec.JobSpec.from_dict` calls these while it parses; each raises `SpecError`
with the field's path (`spec.trainer.env[1].name`), the value and the rule. The CRD's CEL
rules (manifests/crd/trainjob.yaml) refuse most of the same mistakes at admission; these
run again on every reconcile, for objects that reached the API server another way (stored
under an older CRD) and for what the API server cannot know (which schemes agents can
write to, which env sources a pod accepts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from keepstep.operator.errors import SpecError

# Set by the operator or by the agent for its workers: a job's identity and contract.
# Every other KEEPSTEP_* name is reserved too, except these documented settings.
ENV_PREFIX = "KEEPSTEP_"
ENV_SETTINGS = (
    "KEEPSTEP_S3_ENDPOINT",
    "KEEPSTEP_TELEMETRY",
    "KEEPSTEP_TELEMETRY_HOST",
    "KEEPSTEP_TELEMETRY_PORT",
    "KEEPSTEP_TELEMETRY_PATH",
    "KEEPSTEP_TELEMETRY_INTERVAL",
    "KEEPSTEP_REPLY_TIMEOUT",
    "KEEPSTEP_DECISION_TIMEOUT",
    "KEEPSTEP_ADMISSION_TIMEOUT",
    "KEEPSTEP_COLLECTIVE_TIMEOUT",  # the workers' collective bound (keepstep.init)
)
ENV_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
# Durable checkpoints outlive every pod of the job, so their store must be shared: a
# filesystem every node mounts (file://) or an object store. memory:// lives in one process.
CHECKPOINT_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hdfs", "oss")

_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([numkKMGTPE]i?|[eE][+-]?[0-9]+)?$"
)
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
    "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
    "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}  # fmt: skip
_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_QUALIFIED = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def reserved_env(name: str) -> bool:
    """Whether a trainer env name belongs to the operator or the agent."""
    return name.startswith(ENV_PREFIX) and name not in ENV_SETTINGS


def check_env(env: Sequence[Any], where: str = "spec.trainer.env") -> tuple[Mapping[str, Any], ...]:
    """The env entries, each checked: a name that is not reserved, at most one of
    `value` and `valueFrom`, and a `valueFrom` with exactly one source."""
    seen: set[str] = set()
    for i, entry in enumerate(env):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise SpecError(f"{at}={entry!r} must be an object with a name")
        name = entry.get("name")
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise SpecError(f"{at}.name={name!r} must be a C identifier-like variable name")
        if reserved_env(name):
            raise SpecError(
                f"{at}.name={name} is reserved: the operator and the agent set KEEPSTEP_* "
                f"variables themselves; allowed settings: {', '.join(ENV_SETTINGS)}"
            )
        if name in seen:
            raise SpecError(f"{at}.name={name} is listed twice")
        seen.add(name)
        if "value" in entry and "valueFrom" in entry:
            raise SpecError(f"{at} ({name}): set value or valueFrom, not both")
        if "value" in entry and not isinstance(entry["value"], str):
            raise SpecError(f"{at}.value={entry['value']!r} must be a string")
        source = entry.get("valueFrom")
        if "valueFrom" in entry:
            keys = sorted(source) if isinstance(source, Mapping) else []
            if len(keys) != 1 or keys[0] not in ENV_SOURCES:
                raise SpecError(
                    f"{at}.valueFrom ({name}) must name exactly one of {', '.join(ENV_SOURCES)}, "
                    f"not {keys or source!r}"
                )
    return tuple(env)


def quantity(value: Any, where: str) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2Gi", 4) as a number."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise SpecError(f"{where}={value!r} must be a quantity such as 500m, 2Gi or 4")
    match = _QUANTITY.match(str(value))
    if match is None:
        raise SpecError(f"{where}={value!r} is not a quantity (such as 500m, 2Gi or 4)")
    number, suffix = match[1], match[2] or ""
    try:
        scale = _SUFFIX[suffix] if suffix in _SUFFIX else Decimal(10) ** int(suffix[1:])
        amount = Decimal(number) * scale
    except (InvalidOperation, ValueError, KeyError):
        raise SpecError(f"{where}={value!r} is not a quantity (such as 500m, 2Gi or 4)") from None
    if amount < 0:
        raise SpecError(f"{where}={value!r} must not be negative")
    return amount


def check_resources(raw: Any, where: str = "spec.trainer.resourcesPerNode") -> dict[str, Any]:
    """requests and limits: known resource names, quantities, each request <= its limit."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where}={raw!r} must be an object with requests and limits")
    unknown = sorted(set(raw) - {"requests", "limits"})
    if unknown:
        raise SpecError(f"{where}: unknown fields {unknown}; only requests and limits")
    amounts: dict[str, dict[str, Decimal]] = {}
    for part in ("requests", "limits"):
        listed = raw.get(part) or {}
        if not isinstance(listed, Mapping):
            raise SpecError(f"{where}.{part}={listed!r} must map resource names to quantities")
        for name, value in listed.items():
            at = f"{where}.{part}.{name}"
            if not (name in _RESOURCES or name.startswith("hugepages-") or _QUALIFIED.match(name)):
                raise SpecError(
                    f"{at}: {name!r} is not a resource name (cpu, memory, ephemeral-storage, "
                    "hugepages-<size>, or a domain-qualified one such as nvidia.com/gpu)"
                )
            amounts.setdefault(part, {})[name] = quantity(value, at)
    requests, limits = amounts.get("requests", {}), amounts.get("limits", {})
    for name in sorted(requests.keys() & limits.keys()):
        if requests[name] > limits[name]:
            raise SpecError(
                f"{where}.requests.{name}={raw['requests'][name]} must be <= "
                f"{where}.limits.{name}={raw['limits'][name]}"
            )
    return dict(raw)


GPU = "nvidia.com/gpu"


def gpus_per_node(
    resources: Mapping[str, Any], where: str = "spec.trainer.resourcesPerNode"
) -> int:
    """The GPUs a node's pod asks for (its limit, else its request; 0: none), checked by
    ``check_resources`` already; SpecError unless it is a whole number."""
    for part in ("limits", "requests"):
        value = (resources.get(part) or {}).get(GPU)
        if value is not None:
            amount = quantity(value, f"{where}.{part}.{GPU}")
            if amount != amount.to_integral_value():
                raise SpecError(f"{where}.{part}.{GPU}={value!r} must be a whole number of GPUs")
            return int(amount)
    return 0


def check_checkpoint_uri(uri: str, where: str = "spec.checkpoint.uri") -> str:
    """A URL whose scheme names a store every node of the job can reach."""
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme or not rest:
        raise SpecError(f"{where}={uri!r} must be a URL with a scheme, e.g. s3://bucket/job")
    if scheme.lower() not in CHECKPOINT_SCHEMES:
        raise SpecError(
            f"{where}={uri!r}: unknown checkpoint scheme {scheme!r}; use one every node can "
            f"reach: {', '.join(s + '://' for s in CHECKPOINT_SCHEMES)}"
        )
    return uri
