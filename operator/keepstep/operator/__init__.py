"""keepstep.operator: the control loop for TrainJob objects (kopf + the Kubernetes API; no torch).

    python -m keepstep.operator --etcd URL [--namespace NS] [--kubeconfig PATH]

handlers (kopf: events, a pod index, one loop per TrainJob, the finalizer) -> reconcile
(observe; expect lays our own unseen writes over the pod cache) -> decide (pure: Job, pods,
agents, now -> Decision; suspension gates a resumed run) -> kube (the Kubernetes API) and
agents (the job etcd). model, spec, status, podspec and actions are the pure values in
between; settings, connection and errors are built at the entry point (__main__) or shared by all.
"""
