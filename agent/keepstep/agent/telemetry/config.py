"""Where the agent's OpenTelemetry goes: exporters chosen once, at the entry point.

`keepstep agent` (the process a pod runs) calls `TelemetryConfig.from_env(os.environ)`
and hands the result to `telemetry.create_telemetry`; nothing below the entry point
reads the environment (the OTel SDK's own variables are not consulted either: every
value it needs is passed explicitly).

    KEEPSTEP_TELEMETRY              comma list of otlp, prometheus, file, none
                                    (default: otlp if OTEL_EXPORTER_OTLP_ENDPOINT is set,
                                    else none)
    OTEL_EXPORTER_OTLP_ENDPOINT     OTLP/HTTP base URL, e.g. http://collector:4318
    OTEL_EXPORTER_OTLP_HEADERS      k=v,k2=v2 sent with every OTLP request (e.g. auth)
    KEEPSTEP_TELEMETRY_HOST         address the Prometheus endpoint binds (default 0.0.0.0)
    KEEPSTEP_TELEMETRY_PORT         Prometheus scrape port (default 9464)
    KEEPSTEP_TELEMETRY_PATH         folder the file exporter writes to (default .)
    KEEPSTEP_TELEMETRY_INTERVAL     seconds between OTLP/file metric exports (default 10)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from keepstep.errors import ConfigError


class ExporterKind(enum.Enum):
    OTLP = "otlp"
    PROMETHEUS = "prometheus"
    FILE = "file"


_ALLOWED = ", ".join([k.value for k in ExporterKind] + ["none"])


@dataclass(frozen=True)
class TelemetryConfig:
    """`exporters` empty means telemetry is off (the event log is still written)."""

    exporters: frozenset[ExporterKind] = frozenset()
    endpoint: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    host: str = "0.0.0.0"
    port: int = 9464
    path: Path = Path(".")
    interval_s: float = 10.0

    def __post_init__(self) -> None:
        if ExporterKind.OTLP in self.exporters:
            if not self.endpoint:
                raise ConfigError(
                    "telemetry exporter otlp needs an endpoint (OTEL_EXPORTER_OTLP_ENDPOINT, "
                    "e.g. http://collector:4318)"
                )
        if self.endpoint is not None:
            url = urlparse(self.endpoint)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ConfigError(
                    f"OTLP endpoint {self.endpoint!r} must be an http:// or https:// URL "
                    "with a host, e.g. http://collector:4318"
                )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"telemetry port {self.port} must be between 0 and 65535")
        if not self.interval_s > 0:
            raise ConfigError(f"telemetry export interval {self.interval_s} s must be > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TelemetryConfig:
        """Read the variables listed in the module docstring (call it at the entry point)."""
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
        text = env.get("KEEPSTEP_TELEMETRY")
        if text is None:
            text = "otlp" if endpoint else "none"
        return cls(
            exporters=parse_exporters(text),
            endpoint=endpoint,
            headers=parse_headers(env.get("OTEL_EXPORTER_OTLP_HEADERS", "")),
            host=env.get("KEEPSTEP_TELEMETRY_HOST", "0.0.0.0"),
            port=int(_number(env, "KEEPSTEP_TELEMETRY_PORT", 9464, integer=True)),
            path=Path(env.get("KEEPSTEP_TELEMETRY_PATH", ".")),
            interval_s=_number(env, "KEEPSTEP_TELEMETRY_INTERVAL", 10.0),
        )


def parse_exporters(text: str) -> frozenset[ExporterKind]:
    """`"prometheus,file"` -> both; `"none"` or `""` -> none."""
    kinds: set[ExporterKind] = set()
    for part in (p.strip().lower() for p in text.split(",")):
        if part in ("", "none"):
            continue
        try:
            kinds.add(ExporterKind(part))
        except ValueError:
            raise ConfigError(
                f"KEEPSTEP_TELEMETRY={text!r}: unknown exporter {part!r}; allowed: {_ALLOWED}"
            ) from None
    return frozenset(kinds)


def parse_headers(text: str) -> tuple[tuple[str, str], ...]:
    """`"a=1,b=2"` -> (("a", "1"), ("b", "2")); values may be percent-encoded."""
    pairs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ConfigError(
                f"OTEL_EXPORTER_OTLP_HEADERS entry {part!r} must look like name=value"
            )
        pairs.append((name.strip(), unquote(value.strip())))
    return tuple(pairs)


def _number(env: Mapping[str, str], name: str, default: float, *, integer: bool = False) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw) if integer else float(raw)
    except ValueError:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={raw!r} is not {what}") from None
