"""The process-backed node's client of the Kubernetes API: the only code of the node that
talks to the API server.

Where it sits: `noderunner.NodeRunner` calls these methods from its threads. Objects are
plain dicts (the API server's JSON, read with `_preload_content=False`, never turned into
client model classes). Writes are server-side apply under one field manager, so the node
owns exactly the fields it sends and wins over the node lifecycle controller when it comes
back; pod deletion uses a UID precondition so a pod recreated under the same name is never
removed by mistake. Every call carries `_request_timeout`; a watch ends after
`WATCH_S` on the server and can be cut short from another thread with `interrupt_watch`.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from keepstep.e2e.nodeobj import FIELD_MANAGER, LEASE_NAMESPACE

APPLY = "application/apply-patch+yaml"
WATCH_S = 30


class WatchExpired(RuntimeError):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


class NodeApi:
    def __init__(self, kubeconfig: Path, timeout: float) -> None:
        load: Any = config.new_client_from_config  # untyped in the client library
        self._client = load(config_file=str(kubeconfig))
        self._core = client.CoreV1Api(self._client)
        self._coord = client.CoordinationV1Api(self._client)
        self._timeout = timeout
        self._watch_lock = threading.Lock()
        self._watch: Any = None  # the urllib3 response of the watch in progress

    def close(self) -> None:
        self.interrupt_watch()
        self._client.close()

    # -- the Node and its Lease --------------------------------------------------------

    def apply_node(self, body: dict[str, Any]) -> str:
        """Create or update the Node; returns its UID."""
        node = _json(self._core.patch_node(body["metadata"]["name"], body, **self._apply_args()))
        return str(node["metadata"]["uid"])

    def apply_node_status(self, name: str, body: dict[str, Any]) -> None:
        _json(self._core.patch_node_status(name, body, **self._apply_args()))

    def apply_lease(self, name: str, body: dict[str, Any]) -> None:
        _json(self._coord.patch_namespaced_lease(name, LEASE_NAMESPACE, body, **self._apply_args()))

    def delete_node(self, name: str) -> None:
        _ignore_missing(lambda: self._core.delete_node(name, **self._args()))

    def delete_lease(self, name: str) -> None:
        _ignore_missing(
            lambda: self._coord.delete_namespaced_lease(name, LEASE_NAMESPACE, **self._args())
        )

    # -- pods ----------------------------------------------------------------------------

    def list_pods(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        """The pods matching `field_selector` and the list's resourceVersion."""
        found = _json(
            self._core.list_pod_for_all_namespaces(field_selector=field_selector, **self._args())
        )
        return list(found.get("items") or []), str(found["metadata"]["resourceVersion"])

    def watch_pods(
        self, field_selector: str, version: str, keep_going: Callable[[], bool]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, pod) from `version` on, until the server ends the watch, the
        watch is interrupted, or `keep_going()` turns False. Raises WatchExpired on 410."""
        response: Any = self._core.list_pod_for_all_namespaces(
            field_selector=field_selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            watch=True,
            timeout_seconds=WATCH_S,
            _preload_content=False,
            _request_timeout=(self._timeout, WATCH_S + self._timeout),
        )
        with self._watch_lock:
            self._watch = response
        try:
            if not keep_going():
                return  # told to stop before interrupt_watch could see this response
            for line in _lines(response):
                if not keep_going():
                    return
                event = json.loads(line)
                kind, obj = str(event.get("type", "")), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired(str(obj.get("message", "resourceVersion too old")))
                    raise RuntimeError(f"watch error: {obj}")
                yield kind, obj
        finally:
            with self._watch_lock:
                self._watch = None
            response.close()
            response.release_conn()

    def interrupt_watch(self) -> None:
        """End the watch in progress (from any thread): its reader sees the stream end."""
        with self._watch_lock:
            response = self._watch
        if response is not None:
            try:
                response.shutdown()
            except (ValueError, RuntimeError, OSError):
                pass  # already finished

    def apply_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Apply `status` to the pod's status subresource; returns the pod as stored."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        return _json(
            self._core.patch_namespaced_pod_status(name, namespace, body, **self._apply_args())
        )

    def read_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's keys and values, decoded (None: there is no such Secret)."""
        try:
            secret = _json(self._core.read_namespaced_secret(name, namespace, **self._args()))
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return {str(k): base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Remove the pod object now (its process has exited); only this very pod."""
        options = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
        )
        # 409: a pod of the same name but another UID; that one is not ours to remove.
        _ignore_missing(
            lambda: self._core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=0, body=options, **self._args()
            ),
            also=(409,),
        )

    # -- helpers ---------------------------------------------------------------------------

    def _args(self) -> dict[str, Any]:
        return {"_request_timeout": self._timeout, "_preload_content": False}

    def _apply_args(self) -> dict[str, Any]:
        return {
            "field_manager": FIELD_MANAGER,
            "force": True,
            "_content_type": APPLY,
            **self._args(),
        }


def _json(response: Any) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(response.data)
        return data
    finally:
        response.release_conn()


def _ignore_missing(call: Callable[[], Any], also: tuple[int, ...] = ()) -> None:
    try:
        _json(call())
    except ApiException as err:
        if err.status == 404 or err.status in also:
            return
        raise


def _lines(response: Any) -> Iterator[bytes]:
    """The newline-separated JSON events of a watch stream, as they arrive."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line
