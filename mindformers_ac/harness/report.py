"""Print and save the comparison ``train`` produces: a per-layer table, a summary, JSON and a plot."""
import json
import os
import re
from typing import NamedTuple

from ..budget.controller import REPLANNED_OVER_BUDGET
from ..tensors import MiB
from .data_parallel import data_parallel_lines


def _mib(nbytes):
    return f"{nbytes / MiB:.2f}"


class _LayerRow(NamedTuple):
    """One line of the per-layer table, each cell as text (the header is one too)."""

    layer: str
    applied: str
    baseline: str
    kept: str
    recomputed: str
    offloaded: str
    prefetched: str
    on_demand: str
    ops_rerun: str
    calls: str


_HEADER = _LayerRow("layer", "applied", "baseline MiB", "kept MiB", "recomputed MiB", "offloaded MiB",
                    "in time MiB", "on demand MiB", "ops re-run", "calls light/intercepted")
_LEFT_ALIGNED = frozenset(("layer", "applied"))   # words; the figures are right-aligned


class _ModuleBytes(NamedTuple):
    """Bytes one module of a layer kept; sorts largest first with ``reverse=True``."""

    nbytes: int
    module: str


def layer_table(result):
    """The per-layer table as text: what was applied and where the bytes went."""
    rows = [_HEADER]
    for row in result["layers"]:
        calls = row["light_calls"] + row["intercepted_calls"]
        rows.append(_LayerRow(
            layer=str(row["layer"]), applied="; ".join(row["applied"]) or "-",
            baseline=_mib(row["baseline_kept_bytes"]), kept=_mib(row["kept_bytes"]),
            recomputed=_mib(row["recomputed_bytes"]), offloaded=_mib(row["offloaded_bytes"]),
            prefetched=_mib(row["prefetched_bytes"]), on_demand=_mib(row["on_demand_bytes"]),
            ops_rerun=str(row["ops_rerun"]),
            calls=f"{row['light_calls']}/{row['intercepted_calls']}" if calls else "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(_LayerRow._fields))]
    lines = ["  ".join(cell.ljust(w) if name in _LEFT_ALIGNED else cell.rjust(w)
                       for name, cell, w in zip(_LayerRow._fields, r, widths)).rstrip() for r in rows]
    return "\n".join(lines + _intercept_lines(result["layers"]))


def _intercept_lines(layers):
    """Why a layer's calls stayed on the intercepting path (the first reason, and how many more)."""
    why = [(row["layer"], row.get("intercept_reasons") or []) for row in layers]
    why = [(layer, reasons) for layer, reasons in why if reasons]
    if not why:
        return []
    return ["intercepting path kept by:"] + [
        f"  {layer}: {reasons[0]}" + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else "")
        for layer, reasons in why]


def module_table(result, min_bytes=MiB / 200):
    """Where each layer's kept bytes are, without and with AC: per module (``mlp.router``,
    ``mlp.token_dispatcher``, ``mlp.experts`` ...), the recompute regions and what swap left on the device.
    Entries under ``min_bytes`` (0.005 MiB) are left out of the text (``report.json`` has them all)."""
    def parts(counts):
        kept = sorted((_ModuleBytes(n, m) for m, n in counts.items() if n >= min_bytes), reverse=True)
        return ", ".join(f"{e.module} {_mib(e.nbytes)}" for e in kept) or "-"
    lines = ["kept MiB by module (without AC | with AC):"]
    for row in result["layers"]:
        lines.append(f"  {row['layer']}: {parts(row['baseline_kept_by_module'])} | {parts(row['kept_by_module'])}")
    return "\n".join(lines)


def summary_text(result):
    """Memory, time, RSS and the exactness verdict (``exactness.verdict_line``), one line each."""
    from .exactness import verdict_line
    s = result["summary"]
    return "\n".join([
        f"peak activation memory: {_mib(s['baseline_peak_activation_bytes'])} MiB without AC, "
        f"{_mib(s['ac_peak_activation_bytes'])} MiB with AC "
        f"(saving {s['activation_saving_pct']:.1f}%; {_mib(s['offloaded_bytes'])} MiB offloaded to host, "
        f"{_mib(s['recomputed_bytes'])} MiB recomputed)",
        f"step time: {s['baseline_step_time_s'] * 1000:.1f} ms without, {s['ac_step_time_s'] * 1000:.1f} ms with "
        f"(ratio {s['step_time_ratio']:.2f}x, median)",
        f"process peak RSS (VmHWM, sanity figure): {_mib(s['baseline_vm_hwm_bytes'])} MiB without, "
        f"{_mib(s['ac_vm_hwm_bytes'])} MiB with",
        verdict_line(s),
    ] + budget_lines(s.get("memory_budget")) + _pipeline_lines(s.get("pipeline")) \
        + data_parallel_lines(s.get("data_parallel")) + _collectives_lines(s.get("collectives_per_step"),
                           "expert parallel" if result["spec"].get("ep", 1) > 1 else "tensor parallel"))


def budget_lines(budget):
    if not budget:
        return []
    if budget["chosen"] is None:
        return [f"memory budget {budget['activations']}: still profiling when the run ended (give --steps more "
                f"than memory_budget.profile_steps + 1)"]
    measured = budget["measured_peak_bytes"]
    verdict = "within" if measured is not None and measured <= budget["budget_bytes"] else "over"
    lines = [f"memory budget {budget['activations']} = {_mib(budget['budget_bytes'])} MiB: chosen "
             f"{budget['chosen']} (from step {budget['first_step']}; the figures above are from that step on)",
             *([f"  a tie: {budget['tie']}"] if budget.get("tie") else []),
             f"  real peak (kept + largest rebuild + prefetched): predicted {_mib(budget['predicted_peak_bytes'])} "
             f"MiB, measured {_mib(measured) if measured is not None else '-'} MiB: {verdict} the budget"]
    if not budget["fits"]:
        lines.append("  the budget is below the least reachable peak: the plan with the least peak was used")
    if budget["replanned"]:
        lines.append(f"  chosen twice: {budget.get('replanned_because') or REPLANNED_OVER_BUDGET}")
    agreed = budget.get("agreement")
    if agreed and agreed["own_baseline_step_s"] is not None:
        lines.append(f"  chosen together by the {agreed['ranks']} ranks of {agreed['group']}, from the worst rank's "
                     f"figures; this rank ({agreed['rank']}) measured {agreed['own_baseline_step_s'] * 1000:.1f} ms "
                     f"a step without AC, the slowest {budget['baseline_step_s'] * 1000:.1f} ms")
    return lines


def _pipeline_lines(pipeline):
    if not pipeline:
        return []
    p, m = pipeline, pipeline["microbatches"]
    peak, per = p["peak_in_flight_bytes"], p["kept_per_microbatch_bytes"]
    unsplit = "bitwise equal in every step" if p["unsplit_matches"] else \
        "not compared (data parallel)" if p["unsplit_matches"] is None else \
        f"differs from step {p['unsplit_first_difference']['step']} ({p['unsplit_first_difference']['what']})"
    return [f"pipeline stage {p['stage']} of {p['stages']} (layers {p['layers'][0]}-{p['layers'][1]}), {m} "
            f"microbatches in flight ({p['schedule']}): peak activation memory {_mib(peak['baseline'])} MiB "
            f"without AC, {_mib(peak['ac'])} MiB with; per microbatch {_mib(per['baseline'])} / "
            f"{_mib(per['ac'])} MiB",
            f"pipeline without AC against the unsplit model with gradient accumulation over the same "
            f"microbatches (summed in the pipeline's order): {unsplit}"]


def _collectives_lines(per_step, kind):
    if not per_step:
        return []
    lines = [f"collectives in the last step ({kind}):"]
    for label, counts in per_step.items():
        lines.append(f"  {label:>8}: forward {counts['forward']}, backward {counts['backward']}, "
                     f"re-run in backward {counts['rerun_in_backward'] or 0}")
    return lines


def write_report(result, directory):
    """``report.json`` (every figure) and ``memory.png`` in ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    json_path = os.path.join(directory, "report.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    png_path = os.path.join(directory, "memory.png")
    plot_memory(result, png_path)
    return json_path, png_path


_GROUP = re.compile(r"\((group [0-9-]+)\)")   # "full recompute (group 0-1)": a layer group's members


def plot_memory(result, path):
    """Per layer: activation bytes without AC beside with AC, split into kept on device / offloaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["layers"]
    labels = [str(r["layer"]) + "".join(f"\n{m.group(1)}" for a in r["applied"]
                                        for m in [_GROUP.search(a)] if m) for r in rows]
    x = list(range(len(rows)))
    base = [r["baseline_kept_bytes"] / MiB for r in rows]
    kept = [r["kept_bytes"] / MiB for r in rows]
    offloaded = [r["offloaded_bytes"] / MiB for r in rows]
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows) + 2), 4.2))
    ax.bar([i - width / 2 for i in x], base, width, label="without AC (kept on device)", color="#9e9e9e")
    ax.bar([i + width / 2 for i in x], kept, width, label="with AC: kept on device", color="#1f77b4")
    ax.bar([i + width / 2 for i in x], offloaded, width, bottom=kept, label="with AC: offloaded to host",
           color="#ff7f0e", hatch="//", edgecolor="white")
    recomputed = [r["recomputed_bytes"] / MiB for r in rows]
    on_top = [k + o for k, o in zip(kept, offloaded)]
    ax.bar([i + width / 2 for i in x], recomputed, width, bottom=on_top,
           label="with AC: dropped, recomputed in backward", fill=False, hatch="..", edgecolor="#2ca02c",
           linewidth=[1.0 if r > 0 else 0.0 for r in recomputed])   # no outline on empty bars
    top = max(base + [t + r for t, r in zip(on_top, recomputed)] + [1e-9])
    ax.set_ylim(0, top * 1.4)
    s = result["summary"]
    ax.set_title(f"Activation memory per layer: {s['activation_saving_pct']:.0f}% saved on device, "
                 f"step time x{s['step_time_ratio']:.2f}")
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_xlabel("layer")
    ax.set_ylabel("MiB kept for backward")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
