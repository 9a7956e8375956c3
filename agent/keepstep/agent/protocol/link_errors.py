"""The errors of the worker<->agent link, and the codes that carry them across it.

Where it sits: `messages` re-exports them; an agent that cannot answer sends an
`ErrorReply` with an `ErrorCode`, which the worker turns back into the error's type
(`messages.error_reply` / `messages.error_of`), so failures stay types across the link.
"""

from __future__ import annotations

import enum

from keepstep.errors import KeepstepError

__all__ = [
    "AdmissionTimeout",
    "AgentError",
    "AgentUnresponsive",
    "BadMessage",
    "ErrorCode",
    "JobCannotContinue",
    "LinkError",
]


class ErrorCode(enum.StrEnum):
    """Why an agent could not answer a request; each has its error type (`error_of`)."""

    BAD_REQUEST = "bad-request"  # the request did not decode
    ADMISSION_TIMEOUT = "admission-timeout"  # no epoch admitted the worker in time
    JOB_CANNOT_CONTINUE = "job-cannot-continue"  # too few members left for another epoch
    FAILED = "failed"  # anything else (the reason says what)


class LinkError(KeepstepError):
    """Base of the errors of the worker<->agent link."""


class BadMessage(LinkError):
    """A message that does not decode; `field` names the culprit (None: the whole message)."""

    def __init__(self, field: str | None, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"bad link message: {field}: {problem}" if field else problem)


class AgentUnresponsive(LinkError):
    """The node agent did not answer within the request's bound: it is taken for wedged."""


class AdmissionTimeout(LinkError):
    """No epoch admitted the worker within the agent's admission bound."""


class JobCannotContinue(LinkError):
    """Too few members are left (or none can be probed) to form the next epoch, or the
    sharded state an epoch lacks has no holder to admit and no durable checkpoint to fall
    back to."""


class AgentError(LinkError):
    """The agent failed a request for another reason (`code`, and its message)."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        self.code = code
        super().__init__(reason)
