"""The benchmark workload under keepstep: examples/transformer.py's loop plus the step log.

    keepstep run --nodes 4 ... bench/keepstep_job.py <workload flags> --log-dir DIR [--save P]

The loop is the README's ten lines; `keepstep.init` keys data and dropout by (seed, step,
micro-batch) itself, and the harness's workload module keys them the same way for the
other systems. Each attempt of a step logs its work before `step.commit()` (which
reduces) and a commit line when it committed; the leader saves the final parameters.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import keepstep
from harness import workload
from harness.config import add_workload_args, workload_from
from harness.steplog import StepLog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--save", help="final parameters (torch.save) from the leader")
    args = parser.parse_args()
    w = workload_from(args)
    model, optimizer, data = workload.build(w)
    job = keepstep.init(model, optimizer, data, w.global_batch, w.micro_batch, w.seed)
    log: StepLog | None = None
    for step in job.steps(w.steps):
        assert job.membership is not None
        me, epoch = job.membership.me, job.membership.epoch
        if log is None:
            log = StepLog(Path(args.log_dir), me)
        t0 = time.time()
        loss_sum, mbs = 0.0, []
        for mb in step.micro_batches():
            loss = workload.loss_of(model, mb.inputs, mb.targets)
            step.backward(loss)
            loss_sum += loss.item()
            mbs.append(mb.id)
        log.work(epoch, step.index, step.index, mbs, loss_sum, t0)
        if step.commit():
            log.commit(epoch, step.index, [me], len(job.membership.members), t0)
    if job.is_leader and args.save:
        workload.save_params(model, args.save)
    if log is not None:
        log.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
