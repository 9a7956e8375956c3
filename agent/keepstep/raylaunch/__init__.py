"""keepstep.raylaunch: `keepstep run --backend ray`, the same node agents as Ray actors.

The only package that imports ray (an import contract checks it). `config`, `cli`,
`nodes`, `nodeconfig` and `keeper` do not (`actor` only inside its methods), so that the
command line checks its flags before ray is imported and the decisions test without it.

config     `RayConfig` and `RayFault`: the Ray side of a run, checked when made
keeper     the process that ties a node's agent and workers to the life of its actor
actor      `NodeActor`: one per Ray node, starts that node's agent through a keeper
nodes      the launcher's record of each node, and the replacement and growth decisions
nodeconfig the agent configuration of a node, as `keepstep run` writes it
placement  connecting to Ray, the STRICT_SPREAD placement group, creating actors
faults     step-gated faults through Ray: kill an actor or a worker, remove or add a Ray node
launcher   `RayLauncher`: etcd, the actors, replacements, growth, progress, summary
cli        the `--backend ray` flags and `run(config, ray_config)`, the entry point
localcluster  a Ray cluster on this machine: a head and one raylet per node
chaos_target  `RayTarget`: `keepstep chaos run --target ray`, each run on a local cluster
"""
