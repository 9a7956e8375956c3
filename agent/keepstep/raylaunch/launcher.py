"""`RayLauncher`: `keepstep run`'s job with one node agent per Ray node, as a Ray actor.

Where it sits: `cli.run` hands it the local backend's `RunConfig` and a `RayConfig`. It
joins the Ray cluster, reserves one bundle per node in a STRICT_SPREAD placement group
(`placement`), starts the job's etcd on the driver's node as `keepstep run` does (TLS, the
job's own user; or uses the one `--etcd` names), arms the step gates of its faults, and
creates one `NodeActor` per bundle. Each actor starts its node's agent under a `keeper`;
from there the agents train exactly as under `keepstep run`: they notice a lost node
through etcd and go on without it. This loop notices it through Ray (`nodes`: the slot
turns LOST) and asks Ray for a replacement actor in the lost node's bundle
(`nodes.replacements`), which joins the job at a step boundary once Ray has placed it.

The run directory, its events and summary.json are those of `keepstep run`
(`launch.summary`); the run directory must be one path every Ray node sees (one machine,
or a shared file system), like the training script. The summary adds `ray`: each node's
Ray node and fate, and the replacements.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

import ray
from ray.util.placement_group import PlacementGroup

from keepstep.agent import protocol
from keepstep.agent.durable.writer import latest_checkpoint
from keepstep.agent.kv import KVError
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.kv.etcd_auth import enable_auth, grant_job
from keepstep.agent.protocol import ProgressRecord
from keepstep.agent.protocol.events import read_events
from keepstep.errors import ConfigError, KeepstepError
from keepstep.launch.etcd_cluster import RunningEtcd, start_etcd
from keepstep.launch.etcd_tls import LocalAuthority
from keepstep.launch.run import SLOW_READ_S
from keepstep.launch.run_config import RunConfig
from keepstep.launch.summary import build_summary, run_failures
from keepstep.raylaunch import placement
from keepstep.raylaunch.actor import node_address
from keepstep.raylaunch.config import RayConfig
from keepstep.raylaunch.faults import AddNode, RayFaultInjector, RemoveNode
from keepstep.raylaunch.nodeconfig import agent_config, config_json
from keepstep.raylaunch.nodes import NodeSlot, SlotState, growth, replacements

CALL_TIMEOUT_S = 30.0  # one call to an actor that is placed (start, stop)
OP_TIMEOUT_S = 2.0  # one etcd read of the job's progress
SHOW_EVERY_S = 5.0  # a progress line this often
_WORKING = (SlotState.STARTING, SlotState.RUNNING)


class RayLauncher:
    def __init__(
        self,
        cfg: RunConfig,
        ray_cfg: RayConfig,
        out: TextIO,
        remove_node: RemoveNode | None = None,
        add_node: AddNode | None = None,
    ) -> None:
        if cfg.faults:
            raise ConfigError(
                "--backend ray injects kill-node faults through Ray: give them as RayFault"
            )
        if cfg.netns:
            raise ConfigError("--netns is for the local backend: Ray nodes have their own network")
        self.cfg, self.ray_cfg, self.out = cfg, ray_cfg, out
        self.job = f"{cfg.run_dir.name.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
        self.slots: dict[str, NodeSlot] = {}
        self.group: PlacementGroup | None = None  # the job's first group
        self.groups: list[PlacementGroup] = []  # every group, for the end
        self.faults = RayFaultInjector(
            ray_cfg.faults, self.slots, remove_node, self._note, add_node
        )
        self.notes: list[str] = []
        self.shown_at = -SHOW_EVERY_S
        self.resume_step = 0
        self.resume_blob: Path | None = None
        self.etcd_endpoint, self.etcd_tls = "", ray_cfg.etcd_tls

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self._resume()
        owned = placement.connect(self.ray_cfg.address)
        try:
            self.group = placement.place(
                self.ray_cfg.bundle,
                nodes=cfg.nodes,
                min_nodes=cfg.min_nodes,
                timeout=self.ray_cfg.place_timeout,
            )
            self.groups.append(self.group)
            self._note(f"placed {self.group.bundle_count} nodes on distinct Ray nodes")
            self._train()
        finally:
            placement.release(self.groups, owned)
        return self._summary()

    def _resume(self) -> None:
        cfg = self.cfg
        if not cfg.resume:
            return
        found = latest_checkpoint(cfg.resume, 120.0, cfg.storage_options)
        if found is None:
            raise ConfigError(f"--resume {cfg.resume}: no checkpoint there")
        info, blob = found
        if info.step >= cfg.steps:
            raise ConfigError(
                f"--resume {cfg.resume}: the checkpoint is at step {info.step}, "
                f"not before --steps {cfg.steps}"
            )
        self.resume_step, self.resume_blob = info.step, cfg.run_dir / "resume.ckpt"
        self.resume_blob.write_bytes(blob)

    def _start_etcd(self) -> RunningEtcd | None:
        """The job's etcd on this (the driver's) node, TLS and auth as `keepstep run` has
        it; None when `--etcd` gave one."""
        if self.ray_cfg.etcd is not None:
            self.etcd_endpoint = self.ray_cfg.etcd
            return None
        host = node_address()
        authority = LocalAuthority.create(self.cfg.run_dir / "etcd-tls", [host])
        etcd = start_etcd(
            self.cfg.etcd_binary,
            self.cfg.run_dir / "etcd",
            members=self.cfg.etcd_members,
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
        self.etcd_endpoint = etcd.endpoint
        return etcd

    def _train(self) -> None:
        assert self.group is not None
        etcd = self._start_etcd()
        creds = None if self.etcd_tls is None else EtcdCredentials.from_dir(self.etcd_tls)
        kv = EtcdKV(self.etcd_endpoint, credentials=creds)
        try:
            self.faults.arm(kv, self.job)  # before any agent starts: none misses a gate
            for index in range(self.group.bundle_count):
                self._add_slot(self.group, index)
            self._watch(kv)
        finally:
            self._stop_all()
            self.faults.close()
            kv.close()
            if etcd is not None:
                etcd.stop(timeout=10)

    def _add_slot(self, group: PlacementGroup, bundle: int) -> NodeSlot:
        name = f"n{len(self.slots)}"
        actor = placement.create_actor(group, bundle, self.ray_cfg.bundle)
        slot = NodeSlot(
            name=name, group=group, bundle=bundle, actor=actor, pending=actor.where.remote()
        )
        self.slots[name] = slot
        return slot

    def _watch(self, kv: EtcdKV) -> None:
        deadline = time.monotonic() + self.cfg.timeout
        read_at, step = -SLOW_READ_S, 0
        while True:
            if time.monotonic() > deadline:
                raise KeepstepError(f"the job did not finish within {self.cfg.timeout:.0f} s")
            self.faults.on_held()
            self._advance()
            self._replace()
            if not self._going():
                break
            if time.monotonic() - read_at >= SLOW_READ_S:
                read_at = time.monotonic()
                step = self._read_progress(kv, step)
                self._grow()
            wake = self.faults.wake
            if wake is not None:
                wake.wait(self.ray_cfg.poll_interval)
            else:
                time.sleep(self.ray_cfg.poll_interval)

    def _going(self) -> bool:
        """Whether the job still has, or waits for, an agent: one starting or running, or
        one Ray has yet to place while no agent has finished the job."""
        states = [s.state for s in self.slots.values()]
        if any(state in _WORKING for state in states):
            return True
        return SlotState.PLACING in states and not self._finished()

    def _finished(self) -> bool:
        return any(s.state is SlotState.ENDED and s.code == 0 for s in self.slots.values())

    def _advance(self) -> None:
        """Move each slot along with what Ray answered since the last look."""
        waiting = {s.pending: s for s in self.slots.values() if s.pending is not None}
        if not waiting:
            return
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            slot = waiting[ref]
            slot.pending = None
            try:
                answer = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except ray.exceptions.ActorUnavailableError:
                if slot.state is SlotState.PLACING:  # asked again; a poll is asked again below
                    slot.pending = slot.actor.where.remote()
                elif slot.state is SlotState.STARTING:  # did it start? unknown: end it
                    self._lost(slot, "unavailable while its agent started")
                    ray.kill(slot.actor, no_restart=True)
                continue
            except ray.exceptions.RayActorError as error:
                self._lost(slot, type(error).__name__)
                continue
            except ray.exceptions.RayTaskError as error:  # start() raised: no agent there
                self._lost(slot, str(error).strip().splitlines()[-1])
                ray.kill(slot.actor, no_restart=True)
                continue
            self._answered(slot, answer)
        for slot in self.slots.values():
            if slot.state is SlotState.RUNNING and slot.pending is None:
                slot.pending = slot.actor.poll.remote()

    def _answered(self, slot: NodeSlot, answer: Any) -> None:
        if slot.state is SlotState.PLACING:
            slot.ray_node, slot.host = answer
            agent = agent_config(
                self.cfg,
                job=self.job,
                node=slot.name,
                etcd=self.etcd_endpoint,
                etcd_tls=self.etcd_tls,
                host=slot.host,
                expected_nodes=self.group.bundle_count if self.group else self.cfg.nodes,
                resume_blob=self.resume_blob,
                resume_step=self.resume_step,
            )
            text = config_json(agent)
            base = self.cfg.run_dir.resolve() / f"agent-{slot.name}"
            slot.pending = slot.actor.start.remote(text, f"{base}.json", f"{base}.log")
            slot.state = SlotState.STARTING
        elif slot.state is SlotState.STARTING:
            slot.state = SlotState.RUNNING
            self._note(f"node {slot.name} started on Ray node {slot.ray_node[:12]}")
        elif slot.state is SlotState.RUNNING and answer is not None:
            slot.state, slot.code = SlotState.ENDED, int(answer)

    def _lost(self, slot: NodeSlot, why: str) -> None:
        slot.state = SlotState.LOST
        slot.why = why
        self._note(f"node {slot.name}: its Ray actor is gone ({slot.why})")

    def _replace(self) -> None:
        chosen, reason = replacements(
            list(self.slots.values()),
            max_nodes=self.cfg.nodes,
            replace=self.ray_cfg.replace,
            job_finished=self._finished(),
        )
        for choice in chosen:
            old = self.slots[choice.replaces]
            new = self._add_slot(old.group, old.bundle)
            self.slots[choice.replaces].replaced_by = new.name
            self._note(f"{reason}: {new.name} asked of Ray for {choice.replaces}")

    def _grow(self) -> None:
        """Add a node for each Ray node that has room and no agent, up to --max-nodes."""
        hosting = {s.ray_node for s in self.slots.values() if s.state in _WORKING}
        free = [n for n in placement.eligible_nodes(self.ray_cfg.bundle) if n not in hosting]
        count, reason = growth(
            list(self.slots.values()),
            free_nodes=len(free),
            max_nodes=self.cfg.nodes,
            spread_by_resource=placement.spread_by_resource(self.ray_cfg.bundle),
            job_finished=self._finished(),
        )
        for _ in range(count):
            group = placement.place_one(self.ray_cfg.bundle)
            self.groups.append(group)
            new = self._add_slot(group, 0)
            self.faults.grown(new.name)
            self._note(f"growing ({reason}): {new.name} asked of Ray")

    def _read_progress(self, kv: EtcdKV, step: int) -> int:
        try:
            items = kv.get_prefix(protocol.prefix(self.job, "progress"), OP_TIMEOUT_S)
        except KVError:
            return step
        progress = [protocol.decode(ProgressRecord, item.value) for item in items]
        step = max((p.step for p in progress), default=step)
        self.faults.on_progress(step)
        newest = max(progress, key=lambda p: (p.epoch, p.step), default=None)
        now = time.monotonic()
        if now - self.shown_at >= SHOW_EVERY_S:
            self.shown_at = now
            world = newest.world_size if newest is not None else 0
            live = sum(1 for s in self.slots.values() if s.state is SlotState.RUNNING)
            self.out.write(f"step {step}/{self.cfg.steps} | world {world} | Ray actors {live}\n")
            self.out.flush()
        return step

    def _stop_all(self) -> None:
        """Stop every node still placed or running, then end its actor."""
        stops = {}
        for slot in self.slots.values():
            if slot.state in (SlotState.STARTING, SlotState.RUNNING):
                stops[slot.name] = slot.actor.stop.remote()
        for name, ref in stops.items():
            slot = self.slots[name]
            try:
                code = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except ray.exceptions.RayError as error:  # GetTimeoutError included
                self._lost(slot, type(error).__name__)
                continue
            if slot.state is SlotState.RUNNING and code is not None:
                slot.state, slot.code = SlotState.ENDED, int(code)
        for slot in self.slots.values():
            ray.kill(slot.actor, no_restart=True)

    def _summary(self) -> dict[str, Any]:
        cfg = self.cfg
        summary = build_summary(
            read_events(cfg.run_dir),
            self.faults.log,
            steps=cfg.steps,
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            start_step=self.resume_step,
        )
        injected = self.faults.killed()
        codes: dict[str, int | None] = {}
        for slot in self.slots.values():
            if slot.state is SlotState.ENDED:
                codes[slot.name] = slot.code
            elif slot.state is SlotState.LOST and slot.name in injected:
                codes[slot.name] = -9  # SIGKILL with its actor, as the fault meant
        summary["agent_exit_codes"] = codes
        summary["failures"] = run_failures(
            summary, steps=cfg.steps, agent_exits=codes, faults=self.faults.log
        )
        summary["ray"] = {
            "nodes": {
                s.name: {
                    "ray_node": s.ray_node,
                    "bundle": s.bundle,
                    "state": s.state.value,
                    "why": s.why,
                    "replaced_by": s.replaced_by,
                }
                for s in self.slots.values()
            },
            "lost_without_fault": sorted(
                s.name
                for s in self.slots.values()
                if s.state is SlotState.LOST and s.name not in injected
            ),
            "notes": self.notes,
        }
        (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (cfg.run_dir / "faults.json").write_text(json.dumps(self.faults.log, indent=2))
        return summary

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self.out.write(f"keepstep: {text}\n")
        self.out.flush()
