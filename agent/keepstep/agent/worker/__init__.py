"""keepstep.agent.worker: what runs inside the training process beside `keepstep.elastic`.

`controller` is the controller the library talks to when a node agent runs the process:
it asks the agent over the local link (`link_client`, each answer bounded) and connects to
the epochs' process-group stores. It never talks to etcd or to other nodes' agents.
"""
