"""The report of one invocation: a table for the terminal, docs/benchmarks.md and its plots.

Everything is generated from the JSON report bench/run.py writes, so the page is never
edited by hand: `bench/run --json PATH --docs docs/benchmarks.md` rewrites it, with the
plots as SVG files in the `plots/` folder next to it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.plots import NAMES, ORDER, draw_plots

KILLS = ("kill-node", "kill-worker")


def _num(v: Any, fmt: str = "{:.3g}") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return fmt.format(v) if isinstance(v, int | float) else str(v)


def _fault(f: dict[str, Any], kind: str, key: str) -> Any:
    return ((f.get("faults") or {}).get(kind) or {}).get(key)


def _gb(f: dict[str, Any]) -> str:
    g = f.get("global_batch") or {}
    if g.get("min") is None:
        return "–"
    span = str(g["min"]) if g["min"] == g["max"] else f"{g['min']}–{g['max']}"
    below = g.get("steps_below_configured")
    return span + (f" ({below} steps < {g['configured']})" if below else "")


def _samples(f: dict[str, Any], key: str) -> str:
    s = f.get("samples") or {}
    return "–" if s.get(key) is None else f"{s[key]} of {s['expected']}"


ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("steady-state step time (s)", lambda f: _num(f.get("steady_step_s"))),
    ("samples/s (steady state)", lambda f: _num(f.get("samples_per_s"), "{:.1f}")),
    *[
        (
            f"MTTR {kind} p50 / p95 (s)",
            lambda f, k=kind: (
                f"{_num(_fault(f, k, 'mttr_p50_s'))} / {_num(_fault(f, k, 'mttr_p95_s'))}"
            ),
        )
        for kind in KILLS
    ],
    (
        "join-node: stall p50 (s), admitted after p50 (s)",
        lambda f: (
            f"{_num(_fault(f, 'join-node', 'stall_p50_s'))}, "
            f"{_num(_fault(f, 'join-node', 'admitted_p50_s'))}"
        ),
    ),
    (
        "throughput after losing 1 of 4 nodes (x before)",
        lambda f: _num((f.get("throughput_after_loss") or {}).get("fraction"), "{:.2f}"),
    ),
    ("samples lost", lambda f: _samples(f, "lost")),
    ("samples duplicated", lambda f: _samples(f, "duplicated")),
    ("global batch per step", _gb),
    (
        "final loss (fault-free run)",
        lambda f: (
            _num(f.get("final_loss"), "{:.4f}")
            + f" ({_num(f.get('final_loss_fault_free'), '{:.4f}')})"
        ),
    ),
    (
        "loss curve: max abs deviation from fault-free",
        lambda f: _num(f.get("loss_curve_max_abs_deviation")),
    ),
    (
        "parameters: max abs deviation from fault-free",
        lambda f: _num(f.get("param_max_abs_deviation")),
    ),
    (
        "parameters: max abs deviation from DDP",
        lambda f: _num(f.get("param_max_abs_deviation_vs_ddp")),
    ),
    (
        "goodput over the schedule (samples/s)",
        lambda f: _num(f.get("goodput_samples_per_s"), "{:.1f}"),
    ),
    ("goodput / DDP samples/s", lambda f: _num(f.get("goodput_vs_ddp"), "{:.2f}")),
]


def _systems(out: dict[str, Any]) -> list[str]:
    return [s for s in ORDER if s in out["systems"]]


def table_rows(out: dict[str, Any]) -> list[list[str]]:
    systems = _systems(out)
    rows = [["", *(NAMES[s] for s in systems)]]
    for label, cell in ROWS:
        rows.append([label, *(cell(out["systems"][s]) for s in systems)])
    return rows


def ratio_rows(out: dict[str, Any]) -> list[list[str]]:
    others = [s for s in _systems(out) if s != "keepstep" and s in out.get("ratios", {})]
    rows = [["keepstep vs", *(NAMES[s] for s in others)]]
    r = out.get("ratios", {})
    rows.append(
        [
            "step time, keepstep / other",
            *(_num(r[s]["step_time_keepstep_over_other"], "{:.2f}") for s in others),
        ]
    )
    rows.append(
        [
            "samples/s, keepstep / other",
            *(_num(r[s]["samples_per_s_keepstep_over_other"], "{:.2f}") for s in others),
        ]
    )
    for kind in KILLS:
        rows.append(
            [
                f"MTTR {kind} p50, other / keepstep",
                *(_num(r[s]["mttr_p50_other_over_keepstep"].get(kind), "{:.1f}") for s in others),
            ]
        )
    rows.append(
        [
            "throughput after loss, keepstep / other",
            *(_num(r[s]["throughput_after_loss_keepstep_over_other"], "{:.2f}") for s in others),
        ]
    )
    rows.append(
        [
            "goodput, keepstep / other",
            *(_num(r[s]["goodput_keepstep_over_other"], "{:.2f}") for s in others),
        ]
    )
    return rows


def _text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _md_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _target_lines(out: dict[str, Any]) -> list[str]:
    t = out.get("targets", {})
    lines = []
    for kind, v in (t.get("mttr_10x_lower_than_torchrun") or {}).items():
        ratio = _num(v["torchrun_over_keepstep"], "{:.1f}")
        lines.append(f"MTTR {kind} at least 10x lower than torchrun's: {_num(v['met'])} ({ratio}x)")
    ks, ft = t.get("keepstep_no_lost_or_duplicated"), t.get("torchft_loses_or_duplicates")
    lines.append(f"keepstep loses and duplicates no samples: {_num(ks)}; TorchFT does: {_num(ft)}")
    st = t.get("keepstep_step_time_within_10pct_of_ddp") or {}
    ratio = _num(st.get("ratio"), "{:.3f}")
    rounds = ", ".join(_num(r, "{:.3f}") for r in st.get("ratio_by_round") or [])
    lines.append(
        f"keepstep steady-state step time within 10% of DDP's: {_num(st.get('met'))} ({ratio}x;"
        f" by round {rounds})"
    )
    pd = t.get("keepstep_param_deviation_zero") or {}
    lines.append(
        "keepstep parameter deviation from the fault-free run exactly 0: "
        f"{_num(pd.get('met'))} ({_num(pd.get('value'))})"
    )
    return lines


def summary_text(out: dict[str, Any]) -> str:
    parts = ["", _text_table(table_rows(out)), "", _text_table(ratio_rows(out)), ""]
    parts += ["targets:", *("  " + line for line in _target_lines(out))]
    errors = [e for s in out["systems"].values() for e in s.get("errors") or []]
    if errors:
        parts += ["errors:", *("  " + e for e in errors)]
    parts.append(f"({out['seconds']:.0f} s in all)")
    return "\n".join(parts)


def _intro(out: dict[str, Any]) -> list[str]:
    cfg, w, m = out["config"], out["config"]["workload"], out["machine"]
    schedule = ", ".join(f"`{f['spec']}`" for f in out["schedule"])
    job = (
        f"{cfg['nodes']} single-process nodes, {w['steps']} steps, global batch "
        f"{w['global_batch']} ({cfg['n_micro']} micro-batches of {w['micro_batch']}), d_model "
        f"{w['d_model']}, {w['layers']} layers, sequence {w['seq']}"
    )
    return [
        "# Benchmarks: keepstep beside torchrun, TorchFT and plain DDP",
        "",
        "<!-- Generated by bench/run (bench/harness/report.py) from its JSON report; "
        "do not edit by hand. -->",
        "",
        "The same job and the same seeded faults under each system: the example transformer "
        f"(examples/transformer.py, dropout 0.1) on {job}; faults at committed steps: "
        f"{schedule}. Plain DDP runs without faults as the speed reference (and, being the "
        "same script without checkpoints, as torchrun's fault-free reference); keepstep and "
        "TorchFT also run fault-free for the deviation figures. Runs, interleaved in this "
        f"order: {', '.join(out['runs'])}.",
        "",
        "## Command",
        "",
        "```bash",
        out["command"],
        "```",
        "",
        f"Ran {out['started']}, {out['seconds']:.0f} s in all, on: {_machine(m)}. Load average "
        f"before/after: {m['load_average']} / {m.get('load_average_after')} (the machine is "
        "shared: absolute times are noisy; the runs are interleaved so drift hits every system "
        "alike).",
    ]


def _lighthouse(settings: dict[str, Any] | None) -> str:
    if not settings:
        return "settings not recorded"
    return (
        f"min_replicas {settings['min_replicas']}, join timeout "
        f"{settings['join_timeout_ms'] / 1000:g} s, heartbeat timeout "
        f"{settings['heartbeat_timeout_ms'] / 1000:g} s"
    )


def _details(out: dict[str, Any]) -> list[str]:
    """Every run's wall time and every fault's outcome, and the caveats of this machine."""
    lines = ["## Every run", "", "| run | wall (s) | fault outcomes |", "|---|---|---|"]
    for name in _systems(out):
        f = out["systems"][name]
        outcomes = f.get("fault_outcomes") or []
        for label, wall in (f.get("wall_s") or {}).items():
            rep = int(label.rsplit("#", 1)[1])
            mine = [o for o in outcomes if o["repeat"] == rep] if "faults" in label else []
            text = "; ".join(_outcome(o) for o in mine) or "–"
            lines.append(f"| {label} | {wall:.0f} | {text} |")
    m, cfg = out["machine"], out["config"]
    if (m.get("cores") or 0) < cfg["nodes"]:
        lines += [
            "",
            f"This machine has {m.get('cores')} cores for {cfg['nodes']} training processes "
            "(and is shared), so a node lost also frees CPU for the survivors: throughput "
            "after the loss reflects that, not only the lost node's share of the work.",
        ]
    return lines


def _outcome(o: dict[str, Any]) -> str:
    if o["kind"] == "join-node":
        if o.get("admitted_s") is None:
            return "join-node: not admitted before the end"
        return f"join-node: admitted after {o['admitted_s']:.1f} s, stall {o['stall_s']:.2f} s"
    mttr = o.get("mttr_s")
    return f"{o['kind']}: " + ("no recovery" if mttr is None else f"MTTR {mttr:.2f} s")


def _grad_sync_note(mode: str | None) -> str:
    wrapper = (
        "torchft 0.2.0's DistributedDataParallel wrapper crashes the survivors when a peer "
        "dies during the all-reduce on CPU (`assert fut._fut` in torchft/ddp.py's comm hook)"
    )
    if mode == "ddp":
        return f"The gradient goes through that wrapper (`--torchft-grad-sync ddp`); {wrapper}."
    return (
        "The gradient goes through the Manager's fault-tolerant allreduce, one flat buffer "
        f"per step, which is what the wrapper's hook calls: {wrapper}; `bench/run "
        "--torchft-grad-sync ddp` shows it."
    )


def _machine(m: dict[str, Any]) -> str:
    return (
        f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {m['os']}, python "
        f"{m['python']}, torch {m['torch']}, torchft {m['torchft']}"
    )


def _method(out: dict[str, Any]) -> list[str]:
    cfg, m = out["config"], out["machine"]
    ft = out["systems"].get("torchft", {}).get("settings") or {}
    beat = f"{cfg['detect_timeout_s']:g} s"
    return [
        "## How each figure is measured",
        "",
        "- Every process logs the micro-batches it computed in each step attempt (before the "
        "step's reduction) and each commit. The final trajectory takes, per step, its newest "
        "commit and the work in it. Samples are named by (seed, data step, micro-batch), the "
        "keying every system uses here, so lost and duplicated samples are counted alike.",
        "- Step time: the interval between consecutive commits; steady state is the median "
        "over full-world steps after the warm-up, in fault-free runs and before the first "
        "fault. MTTR: fault → commit of the first step attempt that started after it. Join "
        "stall: the longest commit gap from the join to the first full-world commit, minus "
        "the steady step time. Throughput after losing 1 of 4 nodes: samples/s over the steps "
        "after the kill-node's recovery while 3 nodes train (until the replacement is "
        "admitted or the next fault), over samples/s before the first fault. Goodput: samples "
        "trained exactly once per second, first commit to last.",
        f"- torchrun: one elastic agent per node (`--nnodes {cfg['nodes'] - 1}:{cfg['nodes']}`, "
        "c10d rendezvous, `--max-restarts`); rank 0 checkpoints after every step and every "
        f"restart resumes from it. Rendezvous `last_call_timeout` and keep-alive interval {beat} "
        "(defaults 30 s and 5 s).",
        f"- TorchFT {m.get('torchft')}: one replica group per node, `torchft_lighthouse` "
        f"({_lighthouse(ft.get('lighthouse'))}), gloo, data sharded by replica group with a "
        f"per-replica sampler position (`{ft.get('data')}`, as in torchft's example); the "
        "launcher, as the supervisor, restarts a killed worker at once and starts a "
        "replacement group at the join. " + _grad_sync_note(ft.get("grad_sync")),
        f"- keepstep: `keepstep run --hang-timeout {cfg['detect_timeout_s']:g}`, exact mode.",
    ]


def write_docs(out: dict[str, Any], md: Path) -> None:
    """Rewrite the benchmark page `md` and its plots (in `plots/` beside it)."""
    plots = draw_plots(out, md.parent / "plots")
    errors = [e for s in out["systems"].values() for e in s.get("errors") or []]
    lines = [
        *_intro(out),
        "",
        "## Results",
        "",
        _md_table(table_rows(out)),
        "",
        _md_table(ratio_rows(out)),
        "",
        "Targets:",
        "",
        *(f"- {line}" for line in _target_lines(out)),
        "",
        *(f"![{p}](plots/{p})\n" for p in plots),
        *_method(out),
        "",
        *_details(out),
    ]
    if errors:
        lines += ["", "## Errors recorded in this run", "", *(f"- {e}" for e in errors)]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
