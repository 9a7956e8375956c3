"""Per-node network namespaces for `keepstep run --netns`: every simulated node on an
address of its own, so that a chaos partition can cut exactly one node off the network.

Where it sits: the launcher (`run.py`) calls `NodeNetworks.create` before it starts etcd
(which then listens on the bridge address), `add(i)` before it starts node `n<i>`'s agent
under `exec_prefix(i)`, and `close()` in its `finally`. The chaos injector reads the plan
the launcher leaves in the run directory (`load_plan`) and cuts a node with `set_link`;
the chaos leftover check calls `remove_leftovers`. One run's layout:

    root namespace                           namespace keepstep-<token>-n<i>
    bridge ks<token>br  10.201.X.1/24  ──  veth ks<token>h<i> ═ ks<token>n<i>  10.201.X.(i+2)/24

`NetPlan` (names, addresses, the `ip` commands that build and remove it) is pure; only
`NodeNetworks`, `run_ip`, `set_link` and `remove_leftovers` run `ip`. Everything is named
with a token unique to the run, and only what this run created is ever removed.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from keepstep.errors import ConfigError, KeepstepError

PLAN_FILE = "netns.json"  # in the run directory: what the chaos side needs to find
SUBNETS = "10.201"  # each run takes a free 10.201.X.0/24
MAX_NODES = 253  # .1 is the bridge, .2 to .254 the nodes
_TOKEN = re.compile(r"[0-9a-f]{6}")
_TIMEOUT_S = 10.0


class NetnsUnavailable(ConfigError):
    """`--netns` cannot work on this machine (not root, or no `ip`); says which."""


class NetnsError(KeepstepError):
    """An `ip` command failed; the message carries the command and its output."""


def missing(euid: int, ip_path: str | None) -> str | None:
    """Why per-node namespaces cannot be built here, or None when they can."""
    lacks = []
    if euid != 0:
        lacks.append(f"root (running as uid {euid}): namespaces and veth pairs need CAP_NET_ADMIN")
    if ip_path is None:
        lacks.append("the `ip` command (iproute2) on PATH, e.g. apt-get install iproute2")
    return "; ".join(lacks) or None


def free_subnet(observed: str) -> int:
    """The lowest X with no 10.201.X.* in `observed` (the text of `ip -4 addr` and routes)."""
    used = {int(x) for x in re.findall(rf"\b{re.escape(SUBNETS)}\.(\d+)\.\d+", observed)}
    for x in range(256):
        if x not in used:
            return x
    raise NetnsError(f"every subnet {SUBNETS}.0-255.0/24 is in use on this machine")


@dataclass(frozen=True)
class NodeNet:
    node: str  # the agent's node id, n<i>
    namespace: str
    host_veth: str  # the root side, on the bridge: taken down to cut the node off
    node_veth: str  # inside the namespace
    address: str  # what the node's agent and workers publish to their peers


@dataclass(frozen=True)
class NetPlan:
    token: str  # six hex digits: interface names have at most 15 characters
    subnet: int  # X of 10.201.X.0/24

    def __post_init__(self) -> None:
        if not _TOKEN.fullmatch(self.token):
            raise ConfigError(f"netns token {self.token!r} must be six lowercase hex digits")
        if not 0 <= self.subnet <= 255:
            raise ConfigError(f"netns subnet {self.subnet} must be 0..255 (10.201.X.0/24)")

    @property
    def bridge(self) -> str:
        return f"ks{self.token}br"

    @property
    def bridge_address(self) -> str:
        return f"{SUBNETS}.{self.subnet}.1"

    def node(self, index: int) -> NodeNet:
        if not 0 <= index < MAX_NODES:
            raise ConfigError(f"node index {index} must be 0..{MAX_NODES - 1} with --netns")
        return NodeNet(
            node=f"n{index}",
            namespace=f"keepstep-{self.token}-n{index}",
            host_veth=f"ks{self.token}h{index}",
            node_veth=f"ks{self.token}n{index}",
            address=f"{SUBNETS}.{self.subnet}.{index + 2}",
        )

    def bridge_commands(self) -> list[list[str]]:
        """`ip` arguments that build the bridge; the first one creates it."""
        # No STP delay, and bridged frames skip the host's iptables (a FORWARD policy of
        # DROP, as container runtimes set, would otherwise cut every node off).
        options = ["forward_delay", "0", "nf_call_iptables", "0"]
        return [
            ["link", "add", "name", self.bridge, "type", "bridge", *options],
            ["addr", "add", f"{self.bridge_address}/24", "dev", self.bridge],
            ["link", "set", self.bridge, "up"],
        ]

    def node_commands(self, index: int) -> list[list[str]]:
        """`ip` arguments that build node `index`'s namespace: the first creates the
        namespace, the second the veth pair (atomically, both ends or none)."""
        n = self.node(index)
        inside = ["-n", n.namespace]
        peer = ["peer", "name", n.node_veth, "netns", n.namespace]
        return [
            ["netns", "add", n.namespace],
            ["link", "add", n.host_veth, "type", "veth", *peer],
            ["link", "set", n.host_veth, "master", self.bridge, "up"],
            [*inside, "addr", "add", f"{n.address}/24", "dev", n.node_veth],
            [*inside, "link", "set", n.node_veth, "up"],
            [*inside, "link", "set", "lo", "up"],
        ]

    def teardown_commands(
        self, namespaces: Iterable[int], veths: Iterable[int], bridge: bool
    ) -> list[list[str]]:
        """`ip` arguments that remove what was created: veths first (deleting the root end
        removes the pair even while a process still holds the namespace), then the
        namespaces, then the bridge."""
        cmds = [["link", "del", self.node(i).host_veth] for i in sorted(set(veths))]
        cmds += [["netns", "del", self.node(i).namespace] for i in sorted(set(namespaces))]
        if bridge:
            cmds.append(["link", "del", self.bridge])
        return cmds

    def exec_prefix(self, index: int, ip: str = "ip") -> list[str]:
        """Put before a command line to run it in node `index`'s namespace; `ip netns exec`
        execs the command, so its pid (and process group) is the one the launcher started."""
        return [ip, "netns", "exec", self.node(index).namespace]


def leftover_commands(
    plan: NetPlan, nodes: Iterable[int], links: str, namespaces: str
) -> list[tuple[str, list[str]]]:
    """What of the plan still exists, given `ip -o link show` and `ip netns list` output:
    (a description, the `ip` arguments that remove it), in teardown order."""
    link_names = set(re.findall(r"^\d+:\s+([^:@\s]+)", links, re.MULTILINE))
    ns_names = {line.split()[0] for line in namespaces.splitlines() if line.strip()}
    veths = [i for i in nodes if plan.node(i).host_veth in link_names]
    spaces = [i for i in nodes if plan.node(i).namespace in ns_names]
    out = []
    for cmd in plan.teardown_commands(spaces, veths, plan.bridge in link_names):
        kind = "network namespace" if cmd[0] == "netns" else "interface"
        out.append((f"{kind} {cmd[-1]}", cmd))
    return out


def save_plan(path: Path, plan: NetPlan, nodes: Iterable[int]) -> None:
    nets = [plan.node(i) for i in nodes]
    data = {
        "token": plan.token,
        "subnet": plan.subnet,
        "bridge": plan.bridge,
        "bridge_address": plan.bridge_address,
        "nodes": {n.node: vars(n) for n in nets},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # a reader never sees half a file


def load_plan(run_dir: Path) -> tuple[NetPlan, list[int]] | None:
    """The plan a `--netns` launcher left in `run_dir` and its node indices (None: none)."""
    try:
        data = json.loads((run_dir / PLAN_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise NetnsError(f"{run_dir / PLAN_FILE}: {error}") from None
    plan = NetPlan(str(data["token"]), int(data["subnet"]))
    return plan, sorted(int(node.removeprefix("n")) for node in data["nodes"])


def run_ip(ip: str, args: list[str], timeout: float = _TIMEOUT_S) -> str:
    """Run `ip ARGS`; its standard output, or NetnsError with what it printed."""
    try:
        done = subprocess.run(
            [ip, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`ip {' '.join(args)}` did not return within {timeout} s") from None
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.stdout}")
    return done.stdout


def set_link(ip: str, name: str, up: bool, timeout: float = _TIMEOUT_S) -> None:
    """Take an interface up or down (a partition cuts a node's root-side veth)."""
    run_ip(ip, ["link", "set", name, "up" if up else "down"], timeout)


def remove_leftovers(run_dir: Path, ip: str, timeout: float = _TIMEOUT_S) -> list[str]:
    """Remove what a run's plan names and still exists (its launcher was killed before it
    could clean up); returns a line for each thing found."""
    loaded = load_plan(run_dir)
    if loaded is None:
        return []
    plan, nodes = loaded
    try:
        links = run_ip(ip, ["-o", "link", "show"], timeout)
        spaces = run_ip(ip, ["netns", "list"], timeout)
    except NetnsError as error:
        return [f"the network of plan {plan.token} could not be checked: {error}"]
    found = []
    for what, cmd in leftover_commands(plan, nodes, links, spaces):
        try:
            run_ip(ip, cmd, timeout)
            found.append(what)
        except NetnsError as error:
            found.append(f"{what} could not be removed: {error}")
    return found


class NodeNetworks:
    """The namespaces of one run: builds them, and removes exactly what it built."""

    def __init__(self, plan: NetPlan, run_dir: Path, ip: str, timeout: float) -> None:
        self.plan = plan
        self.path = run_dir / PLAN_FILE
        self.ip = ip
        self.timeout = timeout
        self._nodes: list[int] = []  # named in the plan file before they are created
        self._namespaces: list[int] = []
        self._veths: list[int] = []
        self._bridge = False

    @classmethod
    def create(
        cls,
        run_dir: Path,
        *,
        euid: int,
        ip: str | None,
        timeout: float = _TIMEOUT_S,
        token: str | None = None,
    ) -> NodeNetworks:
        """Check the machine, take a free subnet and build the bridge (NetnsUnavailable:
        this machine cannot; NetnsError: an `ip` command failed, nothing is left)."""
        reason = missing(euid, ip)
        if reason is not None or ip is None:
            raise NetnsUnavailable(f"--netns needs {reason}")
        observed = run_ip(ip, ["-o", "-4", "addr", "show"], timeout)
        observed += run_ip(ip, ["-4", "route", "show", "table", "all"], timeout)
        plan = NetPlan(token or uuid.uuid4().hex[:6], free_subnet(observed))
        nets = cls(plan, run_dir, ip, timeout)
        save_plan(nets.path, plan, [])
        try:
            first, *rest = plan.bridge_commands()
            run_ip(ip, first, timeout)
            nets._bridge = True
            for cmd in rest:
                run_ip(ip, cmd, timeout)
        except BaseException:
            nets.close()
            raise
        return nets

    def add(self, index: int) -> NodeNet:
        """Build node `index`'s namespace; on an error, `close` removes what was built."""
        self._nodes.append(index)
        save_plan(self.path, self.plan, self._nodes)
        make_ns, make_veth, *rest = self.plan.node_commands(index)
        run_ip(self.ip, make_ns, self.timeout)
        self._namespaces.append(index)
        run_ip(self.ip, make_veth, self.timeout)
        self._veths.append(index)
        for cmd in rest:
            run_ip(self.ip, cmd, self.timeout)
        return self.plan.node(index)

    def close(self) -> list[str]:
        """Remove everything this object built (idempotent); the errors, if any."""
        errors = []
        cmds = self.plan.teardown_commands(self._namespaces, self._veths, self._bridge)
        self._namespaces, self._veths, self._bridge = [], [], False
        for cmd in cmds:
            try:
                run_ip(self.ip, cmd, self.timeout)
            except NetnsError as error:
                errors.append(str(error))
        return errors
