"""keepstep.agent: one process per node, keeping its training processes in the job.

Each package is a place the code runs, or a boundary it talks across:

    protocol   the etcd key layout and records, the typed messages of the local link to
               workers and their framing, the event log (imports neither torch nor grpc:
               the operator and the tools read it)
    kv         the key-value interface, its in-memory fake, and the etcd client (the only
               etcd code)
    node       the per-node daemon (in a pod, or a simulated node of `keepstep run`)
    worker     what runs inside a training process, beside `keepstep.elastic`
    durable    durable checkpoints in any fsspec storage
    telemetry  OpenTelemetry metrics and traces from a node's events

Beside it, in the same folder: `keepstep.launch` (`keepstep run` on one machine),
`keepstep.chaos` and `keepstep.dashboard` (user tools), and `keepstep.cli`.
"""
