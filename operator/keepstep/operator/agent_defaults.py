"""The environment defaults the operator gives every agent container (`--agent-env`).

A cluster admin points every job's telemetry at the cluster's collector this way (the
chart's `telemetry` values): `--agent-env KEEPSTEP_TELEMETRY=otlp --agent-env
OTEL_EXPORTER_OTLP_ENDPOINT=http://collector.monitoring:4318`.

Where it sits: `__main__` parses the flags with `parse_agent_env`; `settings.DecideConfig`
holds the pairs, checked by `check_agent_env`; `podspec.agent_env` sets them after the job's
identity and before its trainer.env, and leaves out every name the job's trainer.env sets:
the job wins. Only what a job could set itself may be defaulted (the KEEPSTEP_* settings
`fields.ENV_SETTINGS`, and the two OTEL_* variables the agent reads); the agent's SDK reads
no other OTEL_* variable, so defaulting one would change nothing. The values the agent
parses are checked here too, because a bad default would stop every new pod's agent at
start. The defaults reach pods created from then on; running pods keep what they had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from urllib.parse import urlsplit

from keepstep.operator.errors import SpecError
from keepstep.operator.fields import ENV_SETTINGS

OTEL_SETTINGS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_HEADERS")
AGENT_ENV_NAMES = (*ENV_SETTINGS, *OTEL_SETTINGS)
# keepstep.agent.telemetry.config's exporters, which the operator may not import.
EXPORTERS = ("otlp", "prometheus", "file", "none")
# Its value may carry credentials: never repeated in a message.
SECRET = "OTEL_EXPORTER_OTLP_HEADERS"
_ALLOWED = f"allowed names: {', '.join(AGENT_ENV_NAMES)}"

AgentEnv = tuple[tuple[str, str], ...]


def parse_agent_env(values: Sequence[str]) -> AgentEnv:
    """`["NAME=VALUE", ...]` (the repeated flag) as checked (name, value) pairs."""
    pairs = []
    for text in values:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise SpecError(f"agent_env={text!r} must be NAME=VALUE; {_ALLOWED}")
        pairs.append((name, value))
    return check_agent_env(tuple(pairs))


def check_agent_env(pairs: AgentEnv) -> AgentEnv:
    """`pairs` if each name is allowed, given once, with a value the agent accepts; else
    a SpecError naming the entry and the rule."""
    seen: set[str] = set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise SpecError(f"agent_env entry {pair!r} must be a (name, value) pair")
        name, value = pair
        if not isinstance(name, str) or not isinstance(value, str):
            raise SpecError(f"agent_env entry {pair!r}: name and value must be strings")
        shown = f"{name}=<hidden>" if name == SECRET else f"{name}={value}"
        if name not in AGENT_ENV_NAMES:
            raise SpecError(f"agent_env={shown!r}: {name} may not be defaulted; {_ALLOWED}")
        if name in seen:
            raise SpecError(f"agent_env={shown!r}: {name} is given twice")
        seen.add(name)
        rule = _value_rule(name, value)
        if rule:
            raise SpecError(f"agent_env={shown!r}: {rule}")
    return pairs


def _value_rule(name: str, value: str) -> str | None:
    """What is wrong with `value` for `name` as the agent reads it, or None."""
    if name == "KEEPSTEP_TELEMETRY":
        unknown = [p for p in (s.strip().lower() for s in value.split(",")) if p]
        unknown = [p for p in unknown if p not in EXPORTERS]
        if unknown:
            return f"unknown exporter {unknown[0]!r}; a comma list of {', '.join(EXPORTERS)}"
    elif name == "KEEPSTEP_TELEMETRY_PORT":
        if not (value.isascii() and value.isdigit() and int(value) <= 65535):
            return "must be a port 0-65535 (0: chosen at start)"
    elif name == "KEEPSTEP_TELEMETRY_INTERVAL" or name.endswith("_TIMEOUT"):
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            return "must be a number of seconds > 0"
    elif name == "OTEL_EXPORTER_OTLP_ENDPOINT":
        try:
            parts = urlsplit(value)
            host = parts.hostname
        except ValueError:  # a bad IPv6 host
            host = None
        if not host or parts.scheme not in ("http", "https"):
            return "must be an http:// or https:// URL with a host, e.g. http://collector:4318"
    elif name == SECRET:
        entries = [e for e in (s.strip() for s in value.split(",")) if e]
        if any(not e.partition("=")[0].strip() or "=" not in e for e in entries):
            return "must be name=value entries separated by commas"
    return None
