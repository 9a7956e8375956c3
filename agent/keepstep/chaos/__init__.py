"""`keepstep chaos`: seeded, replayable fault schedules against a job, checked by invariants.

The flow: `scenario` (YAML -> frozen dataclasses, `model`) -> `schedule` (the concrete
faults of each run) -> `runner` (a fault-free reference run, cached, then each faulty run
on a `Target`; `local` drives `keepstep run` and `inject`s what it cannot do itself;
cluster mode's target, a TrainJob per run, is `keepstep.e2e.chaos_cluster`) ->
`invariants` (pure checks) -> `report` (JSON and a self-contained HTML page).
"""
