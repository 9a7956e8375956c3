"""What machine a benchmark ran on, for the report (read from /proc and package metadata)."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    cores = os.cpu_count()
    load = [round(x, 2) for x in os.getloadavg()]
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": cores,
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "torchft": _version("torchft"),
        "load_average": load,
    }
    info["summary"] = (
        f"{cores} cores ({info['cpu']}), {info['memory_gib']} GiB, {info['os']}, "
        f"python {info['python']}, torch {info['torch']}, torchft {info['torchft']}, "
        f"load average {load[0]}"
    )
    return info
