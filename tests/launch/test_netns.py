"""Per-node network namespaces (`keepstep run --netns`): the plan as pure functions, then,
as root with `ip`, the real namespaces: built, reachable, cut, and always removed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keepstep.chaos.actions import Partitioned
from keepstep.elastic.errors import ConfigError
from keepstep.launch import netns
from keepstep.launch.netns import (
    MAX_NODES,
    NetnsError,
    NetnsUnavailable,
    NetPlan,
    NodeNetworks,
    free_subnet,
    leftover_commands,
    load_plan,
    missing,
    save_plan,
)
from keepstep.launch.run import Launcher, RunConfig

REPO = Path(__file__).resolve().parents[2]
IP = shutil.which("ip")
WHY_NOT = missing(os.geteuid(), IP)
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=f"--netns needs {WHY_NOT}")


# -- the plan: pure ---------------------------------------------------------------------
def test_names_fit_interfaces_and_addresses_follow_the_node_index() -> None:
    plan = NetPlan("0a1b2c", 7)
    assert plan.bridge == "ks0a1b2cbr" and plan.bridge_address == "10.201.7.1"
    first, last = plan.node(0), plan.node(MAX_NODES - 1)
    assert first.node == "n0" and first.address == "10.201.7.2"
    assert last.address == "10.201.7.254"
    assert first.namespace == "keepstep-0a1b2c-n0"
    assert (first.host_veth, first.node_veth) == ("ks0a1b2ch0", "ks0a1b2cn0")
    # Linux interface names have at most 15 characters.
    assert max(len(n) for n in (plan.bridge, last.host_veth, last.node_veth)) <= 15
    with pytest.raises(ConfigError, match=r"node index 253 must be 0\.\.252"):
        plan.node(MAX_NODES)


@pytest.mark.parametrize(
    ("token", "subnet", "message"),
    [
        ("0A1B2C", 0, "six lowercase hex"),
        ("abc", 0, "six lowercase hex"),
        ("abcdef", 256, r"0\.\.255"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_value(token: str, subnet: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NetPlan(token, subnet)


def test_commands_build_the_bridge_then_each_node_inside_its_namespace() -> None:
    plan = NetPlan("abcdef", 3)
    make_bridge, address, up = plan.bridge_commands()
    assert make_bridge[:6] == ["link", "add", "name", "ksabcdefbr", "type", "bridge"]
    assert "nf_call_iptables" in make_bridge  # the host firewall does not see bridged frames
    assert address == ["addr", "add", "10.201.3.1/24", "dev", "ksabcdefbr"]
    assert up == ["link", "set", "ksabcdefbr", "up"]
    cmds = plan.node_commands(1)
    assert cmds[0] == ["netns", "add", "keepstep-abcdef-n1"]
    assert cmds[1] == [
        "link", "add", "ksabcdefh1", "type", "veth",
        "peer", "name", "ksabcdefn1", "netns", "keepstep-abcdef-n1",
    ]  # fmt: skip
    assert ["link", "set", "ksabcdefh1", "master", "ksabcdefbr", "up"] in cmds
    inside = [c for c in cmds if c[:2] == ["-n", "keepstep-abcdef-n1"]]
    assert ["-n", "keepstep-abcdef-n1", "addr", "add", "10.201.3.3/24", "dev", "ksabcdefn1"] in (
        inside
    )
    assert ["-n", "keepstep-abcdef-n1", "link", "set", "lo", "up"] in inside
    assert plan.exec_prefix(1, "/sbin/ip") == ["/sbin/ip", "netns", "exec", "keepstep-abcdef-n1"]


def test_teardown_removes_only_what_was_built_veths_first() -> None:
    plan = NetPlan("abcdef", 3)
    assert plan.teardown_commands([0, 1], [0], bridge=True) == [
        ["link", "del", "ksabcdefh0"],
        ["netns", "del", "keepstep-abcdef-n0"],
        ["netns", "del", "keepstep-abcdef-n1"],
        ["link", "del", "ksabcdefbr"],
    ]
    assert plan.teardown_commands([], [], bridge=False) == []


def test_free_subnet_skips_every_one_in_use() -> None:
    observed = (
        "2: eth0    inet 10.201.0.1/24 brd 10.201.0.255 scope global eth0\n"
        "10.201.1.0/24 dev br0 proto kernel scope link src 10.201.1.1\n"
        "3: eth1    inet 10.2.0.5/16 scope global eth1\n"
    )
    assert free_subnet(observed) == 2
    assert free_subnet("") == 0
    full = "\n".join(f"inet 10.201.{x}.1/24" for x in range(256))
    with pytest.raises(NetnsError, match="every subnet"):
        free_subnet(full)


def test_leftovers_are_what_the_plan_names_and_still_exists() -> None:
    plan = NetPlan("abcdef", 3)
    links = (
        "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536\n"
        "7: ksabcdefbr: <BROADCAST,MULTICAST,UP> mtu 1500\n"
        "9: ksabcdefh1@if2: <BROADCAST,MULTICAST,UP> mtu 1500\n"
        "11: ksffffffh0@if2: <BROADCAST> mtu 1500\n"  # another run's: never touched
    )
    spaces = "keepstep-abcdef-n1 (id: 1)\nkeepstep-ffffff-n0 (id: 0)\n"
    found = leftover_commands(plan, [0, 1], links, spaces)
    assert found == [
        ("interface ksabcdefh1", ["link", "del", "ksabcdefh1"]),
        ("network namespace keepstep-abcdef-n1", ["netns", "del", "keepstep-abcdef-n1"]),
        ("interface ksabcdefbr", ["link", "del", "ksabcdefbr"]),
    ]
    assert leftover_commands(plan, [0, 1], "1: lo: <LOOPBACK>\n", "") == []


def test_the_plan_file_round_trips(tmp_path: Path) -> None:
    plan = NetPlan("abcdef", 9)
    save_plan(tmp_path / netns.PLAN_FILE, plan, [0, 2])
    assert load_plan(tmp_path) == (plan, [0, 2])
    data = json.loads((tmp_path / netns.PLAN_FILE).read_text())
    assert data["nodes"]["n2"]["host_veth"] == "ksabcdefh2"
    assert load_plan(tmp_path / "elsewhere") is None


def test_missing_names_root_and_ip() -> None:
    assert missing(0, "/usr/sbin/ip") is None
    reason = missing(1000, None)
    assert reason is not None and "root (running as uid 1000)" in reason and "`ip`" in reason
    with pytest.raises(NetnsUnavailable, match=r"--netns needs root \(running as uid 1000\)"):
        NodeNetworks.create(Path("."), euid=1000, ip=IP or "/usr/sbin/ip")
    with pytest.raises(NetnsUnavailable, match="iproute2"):
        NodeNetworks.create(Path("."), euid=0, ip=None)


def test_run_config_bounds_nodes_by_the_subnet(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at most 253 nodes"):
        RunConfig(
            script=str(REPO / "examples" / "mlp.py"),
            script_args=(),
            nodes=254,
            global_batch=1016,
            micro_batch=4,
            steps=1,
            run_dir=tmp_path,
            etcd_binary="etcd",
            netns=True,
        )


# -- the real thing (root and `ip`) -----------------------------------------------------
def _existing(plan: NetPlan) -> list[str]:
    assert IP is not None
    links = netns.run_ip(IP, ["-o", "link", "show"])
    spaces = netns.run_ip(IP, ["netns", "list"])
    return [what for what, _ in leftover_commands(plan, range(4), links, spaces)]


def _in_namespace(plan: NetPlan, index: int, code: str) -> subprocess.Popen[str]:
    assert IP is not None
    return subprocess.Popen(
        [*plan.exec_prefix(index, IP), sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
    )


def _connects(plan: NetPlan, index: int, address: str, port: int, timeout: float) -> bool:
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout={timeout}).close()\n"
        "    print('ok')\n"
        "except OSError:\n"
        "    print('no')\n"
    )
    out, _ = _in_namespace(plan, index, code).communicate(timeout=timeout + 10)
    return out.strip() == "ok"


@needs_root
def test_nodes_reach_each_other_and_the_bridge_a_cut_node_does_not(tmp_path: Path) -> None:
    assert IP is not None
    nets = NodeNetworks.create(tmp_path, euid=os.geteuid(), ip=IP)
    plan = nets.plan
    try:
        assert load_plan(tmp_path) == (plan, [])
        a, b = nets.add(0), nets.add(1)
        assert load_plan(tmp_path) == (plan, [0, 1])
        # A server on the bridge address (where etcd listens) and one in node 0.
        with socket.create_server((plan.bridge_address, 0)) as root_server:
            root_port = root_server.getsockname()[1]
            server = _in_namespace(
                plan,
                0,
                "import socket, time\n"
                f"s = socket.create_server(({a.address!r}, 0))\n"
                "print(s.getsockname()[1], flush=True)\n"
                "time.sleep(30)\n",
            )
            try:
                assert server.stdout is not None
                port = int(server.stdout.readline())
                assert _connects(plan, 1, a.address, port, 5.0)
                assert _connects(plan, 1, plan.bridge_address, root_port, 5.0)
                # Each namespace has its own loopback, and it is up.
                loopback = (
                    "import socket\n"
                    "s = socket.create_server(('127.0.0.1', 0))\n"
                    "socket.create_connection(s.getsockname(), timeout=2).close()\n"
                    "print('ok')\n"
                )
                out, _ = _in_namespace(plan, 1, loopback).communicate(timeout=15)
                assert out.strip() == "ok"
                cut = Partitioned(IP, a.host_veth)
                try:
                    assert not _connects(plan, 1, a.address, port, 1.5)
                    assert _connects(plan, 1, plan.bridge_address, root_port, 5.0)
                finally:
                    cut.end()
                    cut.end()  # idempotent
                assert _connects(plan, 1, a.address, port, 5.0)
            finally:
                server.kill()
                server.communicate(timeout=10)  # reaps it and closes its pipe
        assert b.address == f"10.201.{plan.subnet}.3"
        assert len(_existing(plan)) == 5  # the bridge, two veths, two namespaces
    finally:
        assert nets.close() == []
    assert _existing(plan) == []
    assert nets.close() == []  # idempotent


@needs_root
def test_a_failed_node_setup_leaves_nothing(tmp_path: Path) -> None:
    assert IP is not None
    nets = NodeNetworks.create(tmp_path, euid=os.geteuid(), ip=IP)
    plan = nets.plan
    nets.add(0)
    with pytest.raises(NetnsError, match="File exists"):
        nets.add(0)  # its namespace exists already: the second build fails at once
    nets.close()
    assert _existing(plan) == []
    # What a killed launcher left behind is found from its plan file and removed.
    netns.run_ip(IP, plan.node_commands(1)[0])
    save_plan(tmp_path / netns.PLAN_FILE, plan, [1])
    assert netns.remove_leftovers(tmp_path, IP) == [f"network namespace {plan.node(1).namespace}"]
    assert _existing(plan) == [] and netns.remove_leftovers(tmp_path, IP) == []


@needs_root
def test_the_launcher_removes_its_network_when_it_fails(tmp_path: Path) -> None:
    """etcd cannot start: the error comes out, and no namespace or interface is left."""
    cfg = RunConfig(
        script=str(REPO / "examples" / "mlp.py"),
        script_args=(),
        nodes=2,
        global_batch=8,
        micro_batch=4,
        steps=1,
        run_dir=tmp_path / "run",
        etcd_binary=str(tmp_path / "no-etcd"),
        netns=True,
    )
    with pytest.raises(ConfigError, match="no-etcd"):
        Launcher(cfg, sys.stderr).run()
    loaded = load_plan(tmp_path / "run")
    assert loaded is not None
    assert _existing(loaded[0]) == []


@needs_root
@pytest.mark.slow
def test_ctrl_c_removes_the_network_of_a_running_job(tmp_path: Path, etcd_binary: str) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "KEEPSTEP_ETCD_BIN": etcd_binary}
    job = ["--nodes", "2", "--global-batch", "8", "--micro-batch", "4", "--steps", "500"]
    argv = [sys.executable, "-m", "keepstep", "run", "--netns", *job]
    argv += ["--run-dir", str(run_dir), "--timeout", "60"]
    argv += [str(REPO / "examples" / "mlp.py"), "--sleep", "0.05"]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        # Both agents started inside their namespaces: each published its node address.
        while len(list(run_dir.glob("events-*.jsonl"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        loaded = load_plan(run_dir)
        assert loaded is not None and loaded[1] == [0, 1]
        plan = loaded[0]
        assert len(_existing(plan)) == 5
        config = json.loads((run_dir / "agent-n1.json").read_text())
        assert config["host"] == plan.node(1).address
        assert config["worker_env"]["KEEPSTEP_HOST"] == plan.node(1).address
        assert config["etcd"].startswith(plan.bridge_address + ":")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130, out
    assert _existing(plan) == []
