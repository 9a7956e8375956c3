"""keepstep.agent.node: the per-node daemon, one process per node (in a pod, or a simulated
node of `keepstep run`).

    agent         wiring: the roles below, and what etcd and the supervisor tell it
    config        the frozen configuration a node starts from, and how a worker is started
    cli           `keepstep agent`, the entry point of a pod
    view          the job's records in etcd, kept current by one watch
    agreement     pure decisions: the next epoch from what the agent observed
    healer        applies those decisions with compare-and-set; answers workers that wait
    registration  this node's leased record
    probe         liveness probes between agents
    supervisor    worker processes: start, notice exits, decide restarts
    workers       what the agent knows of each worker: its phase, crashes in a row
    link_server   the agent's half of the local link to its workers
    requests      the answers to the workers' link messages, by message type
    reports       what a worker's reports publish: events, progress, recovery records
    spare         a warm process with torch imported, to replace a crashed worker
    stores        the process-group store this node hosts, and the agent's aborts
    progress      the node's progress record, published off the training path
    durable       durable checkpoints written from the node's snapshot file
"""
