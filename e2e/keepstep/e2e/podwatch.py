"""The process-backed node's view of its pods: list, then watch, into a local cache.

Where it sits: `noderunner.NodeRunner` runs `PodWatch.run` in a thread. It lists the pods
with `spec.nodeName == NODE` through `nodeapi.NodeApi`, then follows the watch from that
list's resourceVersion; every change calls `on_change` (the runner wakes its reconcile
pass), and the reconcile pass reads `snapshot()`. While the node is cut off the cache is
left as it was, and once it is back the pods are listed afresh: events were missed.

`store` keeps the newer of two copies of a pod by resourceVersion, because the runner also
stores the answer to its own status writes, and that answer can race the watch event
that carries the same change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from keepstep.e2e.nodeapi import NodeApi

log = logging.getLogger(__name__)
RETRY_S = 0.25  # between a failed watch and the next list; also the offline poll


class PodWatch:
    def __init__(
        self,
        node: str,
        api: Callable[[], NodeApi],
        online: threading.Event,
        halt: threading.Event,
        on_change: Callable[[], None],
    ) -> None:
        self.node = node
        self._api = api
        self._online = online
        self._halt = halt
        self._on_change = on_change
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}  # uid -> pod, as the API last showed it

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._pods)

    def clear(self) -> None:
        with self._lock:
            self._pods.clear()

    def store(self, pod: dict[str, Any]) -> None:
        uid = pod.get("metadata", {}).get("uid")
        if not uid:
            return
        with self._lock:
            old = self._pods.get(uid)
            if old is None or _version(pod) >= _version(old):
                self._pods[uid] = pod

    def _keep_going(self) -> bool:
        # halt is set before interrupt_watch is called: checked after the watch is
        # registered, it closes the gap between the two.
        return self._online.is_set() and not self._halt.is_set()

    def run(self) -> None:
        """List and watch until `halt` is set; pauses while `online` is clear."""
        selector = f"spec.nodeName={self.node}"
        version: str | None = None
        while not self._halt.is_set():
            if not self._online.is_set():
                version = None  # list afresh once back
                self._halt.wait(RETRY_S)
                continue
            try:
                api = self._api()
                if version is None:
                    pods, version = api.list_pods(selector)
                    with self._lock:
                        self._pods = {p["metadata"]["uid"]: p for p in pods}
                    self._on_change()
                for kind, pod in api.watch_pods(selector, version, self._keep_going):
                    version = pod.get("metadata", {}).get("resourceVersion", version)
                    if kind in ("ADDED", "MODIFIED"):
                        self.store(pod)
                    elif kind == "DELETED":
                        with self._lock:
                            self._pods.pop(pod["metadata"]["uid"], None)
                    self._on_change()
            except Exception as err:  # a 410, a cut-off, a server restart: list again
                if not self._halt.is_set() and self._online.is_set():
                    log.info("node %s: pod watch ended (%s); listing again", self.node, err)
                version = None
                self._halt.wait(RETRY_S)


def _version(pod: Mapping[str, Any]) -> int:
    try:
        return int(pod.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0
