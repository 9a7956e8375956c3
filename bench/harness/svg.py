"""Small self-contained SVG line charts for docs/benchmarks.md (no plotting backend needed).

plotly is installed but its static export needs kaleido, which is not; these few
primitives draw what the page needs: lines per series, vertical markers for faults, axes
with ticks and a legend, in plain SVG that renders wherever the markdown does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

COLORS = {"ddp": "#7f7f7f", "keepstep": "#1f77b4", "torchrun": "#d62728", "torchft": "#2ca02c"}
FAULT_COLORS = {"kill-node": "#d62728", "join-node": "#2ca02c", "kill-worker": "#ff7f0e"}


@dataclass(frozen=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float | None]  # None: a gap
    color: str
    dashed: bool = False


@dataclass(frozen=True)
class Marker:
    x: float
    label: str
    color: str


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def panel(
    series: Sequence[Series],
    markers: Sequence[Marker],
    title: str,
    xlabel: str,
    ylabel: str,
    width: int = 760,
    height: int = 300,
    y0: float = 0.0,
) -> str:
    """One chart as an SVG <g> element of the given size, origin at its top left."""
    left, right, top, bottom = 60, 150, 28, 40
    pw, ph = width - left - right, height - top - bottom
    pts = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=True) if y is not None]
    xs = [p[0] for p in pts] + [m.x for m in markers]
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    ys = [p[1] for p in pts]
    y_lo = min([*ys, y0]) if ys else 0.0
    y_hi = max(ys) * 1.05 if ys else 1.0
    x_hi, y_hi = max(x_hi, x_lo + 1e-9), max(y_hi, y_lo + 1e-9)

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y_lo) / (y_hi - y_lo) * ph

    out = [f'<text x="{left}" y="18" font-size="14" font-weight="bold">{escape(title)}</text>']
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>')
    for t in _ticks(x_lo, x_hi):
        x, label = sx(t), _fmt(t)
        out.append(
            f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 4}" stroke="#555"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{top + ph + 16}" font-size="11" text-anchor="middle">'
            f"{label}</text>"
        )
    for t in _ticks(y_lo, y_hi):
        y, label = sy(t), _fmt(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{label}</text>'
        )
    out.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" font-size="12" text-anchor="middle">'
        f"{escape(xlabel)}</text>"
    )
    out.append(
        f'<text x="14" y="{top + ph / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + ph / 2})">{escape(ylabel)}</text>'
    )
    for k, m in enumerate(markers):
        x = sx(m.x)
        out.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="{m.color}" '
            'stroke-dasharray="4 3"/>'
        )
        # Labels near the right edge go to the left of their line.
        anchor, dx = ("end", -3) if x > left + 0.8 * pw else ("start", 3)
        out.append(
            # Alternate rows, so the labels of close faults do not overlap.
            f'<text x="{x + dx:.1f}" y="{top + 11 + 11 * (k % 2)}" font-size="10" fill="{m.color}" '
            f'text-anchor="{anchor}">{escape(m.label)}</text>'
        )
    for i, s in enumerate(series):
        runs: list[list[str]] = [[]]
        for px, py in zip(s.xs, s.ys, strict=True):
            if py is None:
                runs.append([])
            else:
                runs[-1].append(f"{sx(px):.1f},{sy(py):.1f}")
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        for r in runs:
            if len(r) > 1:
                out.append(
                    f'<polyline points="{" ".join(r)}" fill="none" stroke="{s.color}" '
                    f'stroke-width="1.6"{dash}/>'
                )
            elif r:
                cx, cy = r[0].split(",")
                out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{s.color}"/>')
        ly = top + 12 + 16 * i
        out.append(
            f'<line x1="{left + pw + 12}" y1="{ly - 4}" x2="{left + pw + 32}" y2="{ly - 4}" '
            f'stroke="{s.color}" stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{left + pw + 36}" y="{ly}" font-size="11">{escape(s.name)}</text>')
    return "\n".join(out)


def figure(panels: Sequence[str], width: int = 760, height: int = 300) -> str:
    """Stack panels (each `width` x `height`) into one SVG document."""
    total = height * len(panels)
    body = "\n".join(
        f'<g transform="translate(0 {i * height})">\n{p}\n</g>' for i, p in enumerate(panels)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" '
        f'viewBox="0 0 {width} {total}" font-family="sans-serif">\n'
        f'<rect width="{width}" height="{total}" fill="white"/>\n{body}\n</svg>\n'
    )
