"""Emulates a loaded machine in `keepstep agent` processes (test_worker_exits).

With KEEPSTEP_TEST_STARVE_S set, the agent threads that learn of a worker's exit run that
late: the supervisor's watcher has the exit status but holds on to it (it still holds
the process's wait lock, as a thread waiting for the GIL does), and the link reader has
the end of the worker's connection but has not acted on it. With
KEEPSTEP_TEST_EPOCH_DELAY_S set, each new epoch reaches the agent's view that late.
Nothing else changes. Put this folder on PYTHONPATH to use it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

_STARVE = float(os.environ.get("KEEPSTEP_TEST_STARVE_S", "0"))
_EPOCH_DELAY = float(os.environ.get("KEEPSTEP_TEST_EPOCH_DELAY_S", "0"))

if "--config" in sys.argv and (_STARVE or _EPOCH_DELAY):
    from keepstep.agent.node import view
    from keepstep.agent.protocol import link

    real_try_wait = subprocess.Popen._try_wait  # type: ignore[attr-defined]
    real_receive = link.Connection.receive
    real_apply = view.JobView.apply

    def _try_wait(self: subprocess.Popen[bytes], wait_flags: int) -> Any:
        result = real_try_wait(self, wait_flags)
        if wait_flags == 0 and result[0] == self.pid:
            time.sleep(_STARVE)
        return result

    def _receive(self: link.Connection) -> link.Frame | None:
        frame = real_receive(self)
        if frame is None:
            time.sleep(_STARVE)
        return frame

    def _apply(self: view.JobView, event: Any) -> view.Change:
        if event.key.endswith("/epoch") and self.current is not None:
            time.sleep(_EPOCH_DELAY)
        return real_apply(self, event)

    subprocess.Popen._try_wait = _try_wait  # type: ignore[attr-defined]
    link.Connection.receive = _receive  # type: ignore[method-assign]
    view.JobView.apply = _apply  # type: ignore[method-assign]
