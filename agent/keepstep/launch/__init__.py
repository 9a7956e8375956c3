"""keepstep.launch: `keepstep run`, one job on one machine.

cli            the `keepstep run` command line: torchrun's flag names, every value checked first
run_config     `RunConfig`: the run's settings, checked together when made
devices        `--nproc-per-node N|auto|gpu`, CUDA devices counted without torch
run            the launcher: a private etcd, one agent per simulated node, faults, summary
etcd_server    a private etcd server on loopback, and where to find the etcd binary
etcd_cluster   several etcd members on one host
netns          a network namespace per simulated node (for partitions)
faults         `--fault KIND@step=K` specs
summary        the run summary built from the nodes' event logs
local          a training script as several local processes with a scripted membership
selfcheck      `keepstep selfcheck`: the same numbers for any rank count?
"""
