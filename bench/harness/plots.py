"""The page's plots, drawn from the JSON report as SVG files (harness/svg.py).

loss_curves.svg: training loss per step of every system's faulty run (DDP: fault-free)
and keepstep's fault-free run, the schedule's faults marked at their steps.
throughput.svg: samples/s of every step against time, one panel per system, each with
its own faults marked at the wall time they were injected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import svg

ORDER = ("keepstep", "torchrun", "torchft", "ddp")
NAMES = {"keepstep": "keepstep", "torchrun": "torchrun", "torchft": "TorchFT", "ddp": "DDP"}


def _systems(out: dict[str, Any]) -> list[str]:
    return [s for s in ORDER if s in out["systems"]]


def draw_plots(out: dict[str, Any], folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    systems = _systems(out)
    schedule = out["schedule"]
    loss_series = []
    for s in systems:
        curve = out["systems"][s].get("loss_curve") or []
        loss_series.append(
            svg.Series(
                NAMES[s] + ("" if s == "ddp" else " (faults)"),
                list(range(len(curve))),
                curve,
                svg.COLORS[s],
            )
        )
    ref = out["systems"].get("keepstep", {}).get("loss_curve_fault_free")
    if ref:
        loss_series.append(
            svg.Series(
                "keepstep fault-free",
                list(range(len(ref))),
                ref,
                svg.COLORS["keepstep"],
                dashed=True,
            )
        )
    marks = [
        svg.Marker(f["step"], f["spec"].split("@")[0], svg.FAULT_COLORS.get(f["kind"], "#000"))
        for f in schedule
    ]
    loss = svg.figure(
        [
            svg.panel(
                loss_series,
                marks,
                "Training loss per step (faults marked)",
                "step",
                "loss",
                y0=min((y for s in loss_series for y in s.ys if y is not None), default=0.0),
            )
        ]
    )
    (folder / "loss_curves.svg").write_text(loss)
    panels = []
    for s in systems:
        tl = out["systems"][s].get("timeline") or {}
        if not tl.get("t"):
            continue
        fm = [
            svg.Marker(f["t"], f["kind"], svg.FAULT_COLORS.get(f["kind"], "#000"))
            for f in tl.get("faults", [])
        ]
        # A flat segment per step over its own interval: a stall shows as a long, low one.
        xs, ys = [], []
        for a, b, y in zip(tl["t_from"], tl["t"], tl["samples_per_s"], strict=True):
            xs += [a, b]
            ys += [y, y]
        panels.append(
            svg.panel(
                [svg.Series(NAMES[s], xs, ys, svg.COLORS[s])],
                fm,
                f"{NAMES[s]}: samples/s of each step over its interval"
                + ("" if s == "ddp" else " (faults marked)"),
                "seconds since the first commit",
                "samples/s",
                height=220,
            )
        )
    (folder / "throughput.svg").write_text(svg.figure(panels, height=220))
    return ["loss_curves.svg", "throughput.svg"]
