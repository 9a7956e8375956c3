"""What process a pod becomes on a process-backed node: argv, environment, log file.

Where it sits: `noderunner.NodeRunner` sees a pod bound to its node and asks
`process_spec(pod, ...)` what to run; this module only reads the pod (the API server's
JSON, as a dict) and never starts anything. Only the pod's first container runs, as
`command + args`; its image is ignored, so the process gets the runner's own environment
(PATH holds the `keepstep` command) with the container's `env` on top. `$(NAME)` in env
values, command and args expands as the kubelet does it: to a variable of the container
defined before it, `$$` to `$`, and an unknown name stays as written.

What the kubelet would need an image or another object for (envFrom, secretKeyRef,
configMapKeyRef, resourceFieldRef) is refused with a PodSpecError that says so: a pod that
silently ran with half its environment would be harder to debug. Secret volumes are the
one kind of volume a node provides: it writes the Secret's keys into a folder of its own
(`secret_volumes` says which Secrets a pod needs) and, as the process cannot see that
folder at the mount path, the mount path is rewritten to the folder in the container's
env values and arguments (`process_spec`'s `volumes`).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Pod = Mapping[str, Any]  # a Pod as the API server's JSON

# The fieldRef paths the node can answer; status.podIP and status.hostIP are both the
# node's own address, because every pod process shares the node's network.
FIELD_PATHS = (
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.podIP",
    "status.hostIP",
)
_LABEL_REF = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(ValueError):
    """The pod cannot run on a process-backed node; the message names the field and why."""


@dataclass(frozen=True)
class ProcessSpec:
    """One pod's process: what to exec, its environment, where its output goes."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted (name, value) pairs: the full environment
    log_name: str  # "<namespace>_<pod>.log", inside the runner's work dir

    def __post_init__(self) -> None:
        if not self.argv or not self.argv[0]:
            raise PodSpecError(f"argv={self.argv!r} must name a program to run")
        if "/" in self.log_name or not self.log_name.endswith(".log"):
            raise PodSpecError(f"log_name={self.log_name!r} must be a plain *.log file name")

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def log_path(self, work_dir: Path) -> Path:
        return work_dir / self.log_name


def pod_key(pod: Pod) -> str:
    """ "namespace/name", how the runner's log messages name a pod."""
    meta = pod.get("metadata", {})
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def log_name(namespace: str, name: str) -> str:
    return f"{namespace}_{name}.log"


def termination_file(namespace: str, name: str) -> Path:
    """Where a process-backed pod's container writes its termination message."""
    return Path(tempfile.gettempdir()) / f"keepstep-pod-{namespace}_{name}-termination-log"


def first_container(pod: Pod) -> Mapping[str, Any]:
    containers = pod.get("spec", {}).get("containers") or []
    if not containers:
        raise PodSpecError(f"pod {pod_key(pod)} has no spec.containers")
    container: Mapping[str, Any] = containers[0]
    return container


def secret_volumes(pod: Pod) -> dict[str, str]:
    """Volume name -> Secret name of the pod's secret volumes that its first container
    mounts."""
    mounted = {m.get("name") for m in first_container(pod).get("volumeMounts") or []}
    out = {}
    for volume in pod.get("spec", {}).get("volumes") or []:
        secret = volume.get("secret")
        if secret is not None and volume.get("name") in mounted:
            out[str(volume["name"])] = str(secret.get("secretName", ""))
    return out


def mount_paths(pod: Pod, volumes: Mapping[str, Path]) -> dict[str, str]:
    """Mount path -> the node's folder, for the first container's mounts of `volumes`."""
    out = {}
    for mount in first_container(pod).get("volumeMounts") or []:
        folder = volumes.get(str(mount.get("name")))
        if folder is not None:
            out[str(mount["mountPath"]).rstrip("/")] = str(folder)
    return out


def rewrite_path(text: str, mounts: Mapping[str, str]) -> str:
    """`text` with a leading mount path (the path itself or a file under it) replaced."""
    for path, folder in mounts.items():
        if text == path or text.startswith(path + "/"):
            return folder + text[len(path) :]
    return text


def process_spec(
    pod: Pod,
    node_ip: str,
    base_env: Mapping[str, str],
    volumes: Mapping[str, Path] | None = None,
) -> ProcessSpec:
    """The process that runs `pod`'s first container on the node with address `node_ip`;
    `volumes`: volume name -> the node's folder that holds it (secret volumes)."""
    container = first_container(pod)
    where = f"pod {pod_key(pod)} container {container.get('name', '?')!r}"
    if container.get("envFrom"):
        raise PodSpecError(f"{where}: envFrom is not supported on a process-backed node")
    command = list(container.get("command") or [])
    if not command:
        raise PodSpecError(
            f"{where}: needs a command (images are ignored, so there is no entrypoint)"
        )
    mounts = mount_paths(pod, volumes or {})
    pod_env = {k: rewrite_path(v, mounts) for k, v in container_env(pod, node_ip).items()}
    argv = [expand(part, pod_env) for part in [*command, *(container.get("args") or [])]]
    argv = [rewrite_path(part, mounts) for part in argv]
    env = {**base_env, **pod_env}
    meta = pod.get("metadata", {})
    # The kubelet gives each container a file of its own at terminationMessagePath; here
    # that path would be the host's: the container's argv names a per-pod file instead.
    message_path = container.get("terminationMessagePath")
    if message_path:
        own = str(termination_file(meta.get("namespace", ""), meta.get("name", "")))
        argv = [own if part == message_path else part for part in argv]
    return ProcessSpec(
        argv=tuple(argv),
        env=tuple(sorted(env.items())),
        log_name=log_name(meta.get("namespace", ""), meta.get("name", "")),
    )


def container_env(pod: Pod, node_ip: str) -> dict[str, str]:
    """The first container's `env`, in order, with `value` and `valueFrom.fieldRef`."""
    container = first_container(pod)
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item.get("name", "")
        if not name:
            raise PodSpecError(f"pod {pod_key(pod)}: an env entry has no name: {item!r}")
        source = item.get("valueFrom")
        if source is None:
            env[name] = expand(item.get("value", ""), env)
            continue
        ref = source.get("fieldRef")
        if ref is None:
            kinds = ", ".join(sorted(source)) or "nothing"
            raise PodSpecError(
                f"pod {pod_key(pod)} env {name}: valueFrom {kinds} is not supported "
                "on a process-backed node (only value and valueFrom.fieldRef)"
            )
        env[name] = field_value(pod, str(ref.get("fieldPath", "")), node_ip)
    return env


def field_value(pod: Pod, path: str, node_ip: str) -> str:
    """The value a downward-API fieldRef `path` has for `pod` on this node."""
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    values = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": node_ip,
        "status.hostIP": node_ip,
    }
    if path in values:
        return str(values[path])
    match = _LABEL_REF.match(path)
    if match:
        return str((meta.get(match[1]) or {}).get(match[2], ""))
    allowed = ", ".join(FIELD_PATHS)
    raise PodSpecError(
        f"pod {pod_key(pod)}: fieldRef {path!r} is not supported; allowed: {allowed}, "
        "metadata.labels['KEY'], metadata.annotations['KEY']"
    )


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(NAME) expansion: known names are replaced, `$$` becomes `$`."""

    def one(match: re.Match[str]) -> str:
        name = match[1]
        if name is None:
            return "$"
        return env.get(name, match[0])

    return _VAR_REF.sub(one, text)


def exit_code(returncode: int) -> int:
    """A container exit code from Popen's returncode: death by signal N reads 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def exit_reason(code: int) -> str:
    """The kubelet's reason for a terminated container with exit code `code`."""
    return "Completed" if code == 0 else "Error"
