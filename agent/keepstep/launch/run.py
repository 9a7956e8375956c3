"""`keepstep run`: one job on one machine, each simulated node its own process group.

The launcher starts a private etcd (`--etcd-members 3`: a three-member cluster, which
survives losing any one member; each agent hosts its own process-group store),
starts one node agent per node (`keepstep agent`, in a new session so a node can be
killed or stopped as a whole), injects the scripted faults at their step (the agents hold
the job at that boundary meanwhile: `injector`), shows a progress line, and writes the
run directory: event logs, worker logs, faults, and summary.json. Every process it
started is gone when it returns. Its settings, `RunConfig`, were checked when they were
made (`run_config.py`), before anything started.

With `netns`, each node runs in a network namespace of its own on a bridge (`netns.py`):
its agent and workers publish the namespace's address, etcd listens on the bridge's, and
the namespaces, veths and bridge are removed on the way out, whatever ended the run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from keepstep.agent import protocol
from keepstep.agent.durable.writer import latest_checkpoint, list_checkpoints
from keepstep.agent.kv import KVError
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.kv.etcd_auth import enable_auth, grant_job
from keepstep.agent.node.config import AgentConfig, dump_config, worker_env
from keepstep.agent.protocol import ProgressRecord
from keepstep.agent.protocol.events import read_events
from keepstep.errors import ConfigError, KeepstepError
from keepstep.launch.etcd_cluster import start_etcd
from keepstep.launch.etcd_tls import LocalAuthority
from keepstep.launch.injector import FaultInjector, kill, killpg
from keepstep.launch.netns import NodeNetworks
from keepstep.launch.run_config import RunConfig
from keepstep.launch.summary import build_summary, run_failures

__all__ = ["Launcher", "RunConfig"]

# The launcher looks at its agents every FAST_READ_S (a local call; at once when a step
# gate is held), and reads the job's progress from etcd that often only while a
# step-scheduled fault is near (the fallback for a gate the job passed unheld), else every
# SLOW_READ_S: at ten reads a second it took ~1% of a 4-node run's CPU on 2 cores, with
# etcd's share of each read.
FAST_READ_S = 0.1
SLOW_READ_S = 1.0


class Launcher:
    def __init__(self, cfg: RunConfig, out: TextIO) -> None:
        self.cfg = cfg
        self.out = out
        # Unique per run: abstract sockets and etcd keys of an older run never collide.
        self.job = f"{cfg.run_dir.name.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.last_line = 0.0
        self.stopped: set[str] = set()
        self.faults = FaultInjector(
            cfg.faults,
            cfg.nodes,
            self.agents,
            self._start_node,
            self.stopped,
            self._note,
            self._published if cfg.checkpoint_url else None,
            cfg.checkpoint_every,
        )
        self.faults_log = self.faults.log
        self.networks: NodeNetworks | None = None
        self.etcd_tls: Path | None = None  # the job's etcd credentials, once granted

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.resume_step = 0
        self.resume_blob: Path | None = None
        if cfg.resume:
            found = latest_checkpoint(cfg.resume, 120.0, cfg.storage_options)
            if found is None:
                raise ConfigError(f"--resume {cfg.resume}: no checkpoint there")
            info, blob = found
            if info.step >= cfg.steps:
                raise ConfigError(
                    f"--resume {cfg.resume}: the checkpoint is at step "
                    f"{info.step}, not before --steps {cfg.steps}"
                )
            self.resume_step, self.resume_blob = info.step, cfg.run_dir / "resume.ckpt"
            self.resume_blob.write_bytes(blob)
            self._note(f"resuming from step {info.step} ({info.url})")
        if cfg.netns:
            ip = shutil.which("ip")
            self.networks = NodeNetworks.create(cfg.run_dir, euid=os.geteuid(), ip=ip)
        try:
            self._train()
        finally:
            if self.networks is not None:
                for error in self.networks.close():
                    self._note(f"network cleanup: {error}")
        summary = build_summary(
            read_events(cfg.run_dir),
            self.faults_log,
            steps=cfg.steps,
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            start_step=self.resume_step,
        )
        codes = {n: p.returncode for n, p in self.agents.items()}
        summary["agent_exit_codes"] = codes
        # Every agent's exit counts: one can fail after training (its durable checkpoint).
        summary["failures"] = run_failures(
            summary,
            steps=cfg.steps,
            agent_exits=codes,
            faults=self.faults_log,
            agent_reasons={n: _agent_reason(cfg.run_dir, n) for n, c in codes.items() if c},
        )
        (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (cfg.run_dir / "faults.json").write_text(json.dumps(self.faults_log, indent=2))
        return summary

    def _train(self) -> None:
        cfg = self.cfg
        # Namespaced nodes reach etcd on the bridge; so does the launcher (a local address).
        host = self.networks.plan.bridge_address if self.networks else "127.0.0.1"
        # TLS and auth as on a cluster: the job's agents (and this launcher's reads) act as
        # the job's etcd user, which may touch the job's prefix only.
        authority = LocalAuthority.create(cfg.run_dir / "etcd-tls", [host])
        etcd = start_etcd(
            cfg.etcd_binary,
            cfg.run_dir / "etcd",
            members=cfg.etcd_members,
            host=host,
            tls=authority.server,
        )
        try:
            with EtcdKV(etcd.endpoint, credentials=authority.root) as root:
                enable_auth(root)
                grant_job(root, self.job)
            self.etcd_tls = authority.job_credentials(self.job)
        except BaseException:
            etcd.stop(timeout=10)
            raise
        # "h:p", or every member's "h:p,h:p,h:p" for a cluster.
        kv = EtcdKV(etcd.endpoint, credentials=EtcdCredentials.from_dir(self.etcd_tls))
        try:
            self.etcd_endpoint = etcd.endpoint
            self.faults.arm(kv, self.job)  # before any agent starts: none misses a gate
            for i in range(cfg.nodes):
                self._start_node(f"n{i}")
            self._watch(kv)
        finally:
            self.faults.lift_all()  # a node stopped by a duty cycle would not hear SIGTERM
            self._stop_all()
            self.faults.close()
            kv.close()
            etcd.stop(timeout=10)

    def _start_node(self, node: str) -> None:
        cfg = self.cfg
        host, prefix = "127.0.0.1", []
        if self.networks is not None:
            index = int(node.removeprefix("n"))
            host = self.networks.add(index).address
            prefix = self.networks.plan.exec_prefix(index, self.networks.ip)
        agent_cfg = agent_config(
            cfg,
            job=self.job,
            node=node,
            etcd=self.etcd_endpoint,
            etcd_tls=self.etcd_tls,
            host=host,
            expected_nodes=cfg.nodes,
            resume_blob=self.resume_blob,
            resume_step=self.resume_step,
        )
        path = cfg.run_dir / f"agent-{node}.json"
        dump_config(agent_cfg, path)
        with open(cfg.run_dir / f"agent-{node}.log", "ab") as log:
            self.agents[node] = subprocess.Popen(
                [*prefix, sys.executable, "-m", "keepstep", "agent", "--config", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _watch(self, kv: EtcdKV) -> None:
        deadline = time.monotonic() + self.cfg.timeout
        step, rate, read_at = 0, 0.0, -math.inf
        # Nodes the launcher stopped (hang faults) stay stopped: they are killed at the end.
        while any(p.poll() is None for n, p in self.agents.items() if n not in self.stopped):
            if time.monotonic() > deadline:
                raise KeepstepError(f"the job did not finish within {self.cfg.timeout:.0f} s")
            self.faults.on_held()
            self.faults.tick()
            if time.monotonic() - read_at >= self._read_interval(step, rate):
                read_at = time.monotonic()
                step, rate = self._read_progress(kv) or (step, rate)
            wake = self.faults.wake
            if wake is not None:
                wake.wait(FAST_READ_S)
            else:
                time.sleep(FAST_READ_S)
        self._show(self.cfg.steps, None, final=True)

    def _read_interval(self, step: int, rate: float) -> float:
        """Every etcd read takes CPU from the training it watches: read often only while a
        step-scheduled fault is near, so that one the job passes unheld (its gate was not
        armed, or no agent could hold it) still lands within a step or two of its step."""
        due = self.faults.next_step()
        if due is None:
            return SLOW_READ_S
        if rate <= 0:  # no rate published yet: the job may be faster than any slow read
            return FAST_READ_S
        near = max(2.0, rate * 2 * SLOW_READ_S)  # steps the job may make in two slow reads
        return FAST_READ_S if due - step <= near else SLOW_READ_S

    def _read_progress(self, kv: EtcdKV) -> tuple[int, float] | None:
        """Read the nodes' progress, inject the faults the job passed unheld, show the
        progress line; return the job's step and its rate in steps a second (None: etcd did
        not answer)."""
        try:
            progress = [
                protocol.decode(ProgressRecord, item.value)
                for item in kv.get_prefix(protocol.prefix(self.job, "progress"), 2.0)
            ]
        except KVError:
            return None
        step = max((p.step for p in progress), default=0)
        self.faults.on_progress(step)
        # The newest record (the epoch leader's, published most often) speaks for the job.
        newest = max(progress, key=lambda p: (p.epoch, p.step), default=None)
        self._show(step, newest)
        rate = newest.samples_per_s / self.cfg.global_batch if newest is not None else 0.0
        return step, rate

    def _published(self) -> int:
        """The step of the newest published durable checkpoint (-1: none, or unreadable)."""
        assert self.cfg.checkpoint_url is not None
        try:
            found = list_checkpoints(self.cfg.checkpoint_url, 5.0, self.cfg.storage_options)
        except (KeepstepError, OSError):
            return -1
        return max((info.step for info in found), default=-1)

    def _note(self, text: str) -> None:
        prefix = "\r" if self.out.isatty() else ""
        self.out.write(f"{prefix}keepstep: {text}\033[K\n" if prefix else f"keepstep: {text}\n")
        self.out.flush()

    def _show(self, step: int, newest: ProgressRecord | None, final: bool = False) -> None:
        now = time.monotonic()
        every = 0.2 if self.out.isatty() else 5.0
        if not final and now - self.last_line < every:
            return
        self.last_line = now
        world = newest.world_size if newest is not None else 0
        rate = newest.samples_per_s if newest is not None else 0.0
        line = f"step {step}/{self.cfg.steps} | world {world} | {rate:.0f} samples/s"
        if self.faults_log:
            line += f" | faults {len(self.faults_log)}"
        if self.out.isatty() and not final:
            self.out.write(f"\r{line}\033[K")
        elif not final:
            self.out.write(line + "\n")
        self.out.flush()

    def _stop_all(self) -> None:
        """End every node this launcher started: the whole process group, by its id."""
        for node, proc in self.agents.items():
            if node in self.stopped:
                killpg(proc, signal.SIGKILL)
            elif proc.poll() is None:
                kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self.agents.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.agents.values():
            killpg(proc, signal.SIGKILL)  # workers of a killed agent, if any are left
            if proc.poll() is None:
                proc.wait(timeout=5)
        for leftover in self.cfg.run_dir.glob("agent-*.json"):
            node = leftover.stem.removeprefix("agent-")
            for shm in Path("/dev/shm").glob(f"keepstep-{self.job}-{node}-*"):
                shm.unlink(missing_ok=True)


def _agent_reason(run_dir: Path, node: str) -> str:
    """What a failed agent said last about why (`run_agent` prints it), or ""."""
    said = f"keepstep agent {node}: "
    try:
        with open(run_dir / f"agent-{node}.log", "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - 64 * 1024, 0))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    found = [line.removeprefix(said) for line in lines if line.startswith(said)]
    return found[-1] if found else ""


def agent_config(
    cfg: RunConfig,
    *,
    job: str,
    node: str,
    etcd: str,
    etcd_tls: Path | None,
    host: str,
    expected_nodes: int,
    resume_blob: Path | None,
    resume_step: int,
) -> AgentConfig:
    """One node's agent configuration, as `keepstep run` gives it (the Ray launcher too)."""
    return AgentConfig(
        job=job,
        node=node,
        etcd=etcd,
        etcd_tls=None if etcd_tls is None else etcd_tls.resolve(),
        script=cfg.script if cfg.module else str(Path(cfg.script).resolve()),
        script_args=cfg.script_args,
        # -m: the module is found as `python -m` finds it, from the launcher's directory.
        command=(sys.executable, "-m", cfg.script, *cfg.script_args) if cfg.module else (),
        max_restarts=cfg.max_restarts,
        nproc=cfg.nproc_per_node,
        run_dir=cfg.run_dir.resolve(),
        worker_env=worker_env(
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            steps=cfg.steps,
            seed=cfg.seed,
            mode=cfg.mode,
            host=host,
            extra={**cfg.extra_env, **cfg.balance_env()},
        ),
        expected_nodes=expected_nodes,
        min_nodes=min(cfg.min_nodes, expected_nodes),
        admission_grace=cfg.admission_grace,
        lease_ttl=cfg.lease_ttl,
        heartbeat_timeout=cfg.heartbeat_timeout,
        warm_spare=cfg.warm_spare,
        steps=cfg.steps,
        checkpoint_url=cfg.checkpoint_url,
        checkpoint_every=cfg.checkpoint_every,
        storage_options=dict(cfg.storage_options),
        resume_blob=resume_blob,
        resume_step=resume_step,
        host=host,
    )
