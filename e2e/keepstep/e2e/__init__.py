"""keepstep.e2e: test infrastructure, never shipped in an image.

A real local Kubernetes control plane (built from source, started on loopback),
process-backed nodes that run the pods the scheduler binds to them, the `e2e/cluster`
command, and the chaos harness. It may import every other part of keepstep.
"""
