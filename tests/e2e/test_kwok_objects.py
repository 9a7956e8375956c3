"""The pure parts of the kwok helpers: the kwok command line, the fake Node objects, and
what counts as schedulable. No API server here (tests/e2e/test_kwok.py has one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keepstep.e2e.kwok import KwokConfig
from keepstep.e2e.kwok_nodes import node_manifest, schedulable


def test_kwok_plays_only_the_nodes_with_its_annotation_value() -> None:
    config = KwokConfig(Path("/k/config"), Path("/w"), manage="t-1a2b3c", lease_duration_s=20)
    argv = config.argv(Path("/bin/kwok"), Path("/bin/stage/default.yaml"), 4321)
    assert argv[0] == "/bin/kwok"
    assert "--manage-all-nodes=false" in argv
    assert "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=t-1a2b3c" in argv
    assert "--node-lease-duration-seconds=20" in argv
    assert "--config=/bin/stage/default.yaml" in argv
    assert "--server-address=127.0.0.1:4321" in argv  # its /healthz, on loopback only
    assert "--cidr=10.240.0.1/16" in argv  # room for more than 254 pods

    node = node_manifest("kw-0", "t-1a2b3c")
    assert node["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "t-1a2b3c"}
    assert node["metadata"]["labels"]["keepstep.dev/kwok"] == "t-1a2b3c"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "kw-0"
    assert "status" not in node  # kwok writes it


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"manage": "has space"}, "manage='has space'"),
        ({"manage": ""}, "manage=''"),
        ({"lease_duration_s": 2}, "lease_duration_s=2"),
        ({"cidr": "10.0.0.0/99"}, "cidr='10.0.0.0/99'"),
    ],
)
def test_a_bad_kwok_config_names_the_value(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        KwokConfig(Path("/k"), Path("/w"), **changes)


def ready(status: str, taints: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]},
        "status": {"conditions": [{"type": "Ready", "status": status}]},
    }


def test_schedulable_means_ready_and_no_longer_tainted_not_ready() -> None:
    assert schedulable(ready("True"))
    assert schedulable(ready("True", ("keepstep.dev/other",)))
    assert not schedulable(ready("True", ("node.kubernetes.io/not-ready",)))
    assert not schedulable(ready("Unknown"))
    assert not schedulable(ready("True", ("node.kubernetes.io/unreachable",)))
    assert not schedulable({"metadata": {"name": "new"}})
