"""keepstep: elastic, fault-tolerant PyTorch training.

`import keepstep` re-exports the training-script API of `keepstep.elastic` lazily, so
that the operator (which never installs torch) can import `keepstep.operator` freely.
"""

from __future__ import annotations

from typing import Any

# The package is spread over elastic/, agent/ and operator/. Extend the search path in
# place, so the module spec (which tools such as import-linter read) sees every portion.
__path__[:] = __import__("pkgutil").extend_path(__path__, __name__)

_API = ("init", "device", "Job", "Step", "MicroBatch", "JobConfig", "ReduceMode", "OptimizerGroup")


def __getattr__(name: str) -> Any:
    if name in _API:
        from keepstep import elastic

        return getattr(elastic, name)
    raise AttributeError(f"module 'keepstep' has no attribute {name!r}")
