"""The static memory chart (PNG) a `%%distributed` cell leaves behind, drawn with matplotlib.

It follows the live chart's conventions (labextension/src/chart): per rank, the tensor
categories stacked on an axis zoomed to them (so 1 MiB of parameters is not a sliver under
400 MiB of interpreter), the estimate dashed, the peak marked; on CPU the process RSS is its
own line on a second axis, not a block under the stack; time in seconds since the cell started.
Where the ranks sent bytes over torch.distributed, a lower panel per rank draws bytes sent per second.
No torch here: this runs in the notebook kernel.
"""

from __future__ import annotations

import io
import itertools
from typing import Any

from mpnb.monitoring.protocol import CATEGORIES, Sample
from mpnb.units import format_bytes

COLORS = {
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer": "#59a14f",
    "activations": "#b07aa1",
    "other": "#bab0ac",
}
LABELS = {"activations": "activations (tracked)"}
RSS_COLOR = "#555555"
ESTIMATE_COLOR = "#7b3294"
CAPACITY_COLOR = "#c44e52"
SENT_COLOR = "#2a9d8f"  # the live chart's (labextension/src/chart/legend.ts)


def stack_top(sample: Sample) -> int:
    """Bytes the stacked categories reach in one sample."""
    return sum(int(sample.get(c, 0) or 0) for c in CATEGORIES)


def sent_rates(samples: list[Sample]) -> tuple[list[float], list[float]]:
    """One rank's bytes sent per second over each interval between its samples: (end times, rates).

    Only intervals whose two ends carry `comm_sent` count; a counter that went down (the
    engine was replaced) gives none.
    """
    ends: list[float] = []
    rates: list[float] = []
    for before, after in itertools.pairwise(samples):
        a, b, dt = before.get("comm_sent"), after.get("comm_sent"), after["t"] - before["t"]
        if a is not None and b is not None and b >= a and dt > 0:
            ends.append(after["t"])
            rates.append((b - a) / dt)
    return ends, rates


def scale_unit(top: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return float(scale), unit
    return 1.0, "B"


def render_png(
    samples: list[Sample],
    estimate: dict[int, int] | None = None,
    title: str = "memory per rank",
    t0: float | None = None,
) -> bytes:
    """Per rank: stacked categories, estimate dashed, peak marked, CPU RSS on a right axis, and under
    them bytes sent per second when any rank sent some; PNG bytes.

    `t0`: the time axis origin (the cell's start); default the first sample.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_rank: dict[int, list[Sample]] = {}
    for sample in samples:
        by_rank.setdefault(int(sample["rank"]), []).append(sample)
    for data in by_rank.values():
        data.sort(key=lambda s: s["t"])
    ranks = sorted(by_rank) or [0]
    cols = min(len(ranks), 4)
    rows = (len(ranks) + cols - 1) // cols
    rates = {rank: sent_rates(data) for rank, data in by_rank.items()}
    rate_top = max((r for _, rs in rates.values() for r in rs), default=0.0)
    per_rank = 2 if rate_top > 0 else 1  # a memory axis, and under it one for bytes sent per second
    fig = Figure(figsize=(3.6 * cols, (2.5 + 0.8 * (per_rank - 1)) * rows), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows * per_rank, cols, squeeze=False, height_ratios=[3, 1][:per_rank] * rows)
    if t0 is None:
        t0 = min((s["t"] for s in samples), default=0.0)
    # The left axis is zoomed to the stacked categories and the estimate, never to the RSS.
    top = max((stack_top(s) for s in samples), default=0)
    if estimate:
        top = max(top, *(estimate.get(r, 0) for r in ranks))
    top = max(top, 1 << 20)
    scale, unit = scale_unit(top)
    rss_top = max((s["used"] for s in samples if s.get("device_kind") == "cpu"), default=0)
    rss_scale, rss_unit = scale_unit(rss_top)
    rate_scale, rate_unit = scale_unit(rate_top)
    handles: dict[str, Any] = {}
    for i, rank in enumerate(ranks):
        row, col = i // cols * per_rank, i % cols
        ax = axes[row][col]
        bottom = axes[row + per_rank - 1][col]  # the time axis is labelled under the rank's last panel
        data = by_rank.get(rank, [])
        ax.set_title(f"rank {rank}", fontsize=9)
        if not data:
            continue
        t = [s["t"] - t0 for s in data]
        shown = [c for c in CATEGORIES if any(s.get(c, 0) for s in data)] or ["parameters"]
        stacks = [[s.get(c, 0) / scale for s in data] for c in shown]
        polys = ax.stackplot(t, *stacks, colors=[COLORS[c] for c in shown], alpha=0.9)
        handles.update({LABELS.get(c, c): p for c, p in zip(shown, polys, strict=True)})
        peak = max(data, key=stack_top)
        peak_t, peak_v = peak["t"] - t0, stack_top(peak) / scale
        ax.plot([peak_t], [peak_v], "v", color=CAPACITY_COLOR, markersize=6)
        # centred on the marker, but anchored on the side that keeps the label inside the frame
        where = (peak_t - t[0]) / max(t[-1] - t[0], 1e-9)
        ha = "left" if where < 0.25 else "right" if where > 0.75 else "center"
        ax.annotate(f"peak {format_bytes(stack_top(peak))}", (peak_t, peak_v), textcoords="offset points",
                    xytext=({"left": -3, "right": 3, "center": 0}[ha], 6), ha=ha, fontsize=7)
        if estimate and rank in estimate:
            handles["estimate"] = ax.axhline(estimate[rank] / scale, color=ESTIMATE_COLOR, linestyle="--",
                                             linewidth=1)
        capacity = data[-1].get("capacity") or 0
        # The device limit only where it is in view; a CPU's RAM would flatten everything else.
        if capacity and capacity <= 1.5 * top and data[-1].get("device_kind") == "cuda":
            handles["capacity"] = ax.axhline(capacity / scale, color=CAPACITY_COLOR, linewidth=1.2)
        if rss_top and any(s.get("device_kind") == "cpu" for s in data):
            right = ax.twinx()
            (handles["process RSS (right)"],) = right.plot(t, [s["used"] / rss_scale for s in data],
                                                           color=RSS_COLOR, linewidth=1.2)
            right.set_ylim(0, rss_top * 1.18 / rss_scale)
            right.tick_params(labelsize=7, colors=RSS_COLOR)
            if i % cols == cols - 1 or i == len(ranks) - 1:
                right.set_ylabel(f"RSS, {rss_unit}", fontsize=8, color=RSS_COLOR)
        ax.set_xlim(left=0)
        ax.tick_params(labelsize=7, labelleft=col == 0)
        ax.set_ylim(0, top * 1.18 / scale)  # headroom for the peak label
        if per_rank == 2:
            ends, rank_rates = rates.get(rank, ([], []))
            bottom.sharex(ax)
            ax.tick_params(labelbottom=False)
            if ends:
                handles["sent per second"] = bottom.fill_between(
                    [e - t0 for e in ends], [r / rate_scale for r in rank_rates], step="pre",
                    color=SENT_COLOR, alpha=0.8, linewidth=0)
            bottom.set_ylim(0, rate_top * 1.1 / rate_scale)
            bottom.tick_params(labelsize=7, labelleft=col == 0)
            if col == 0:
                bottom.set_ylabel(f"sent, {rate_unit}/s", fontsize=7)
        bottom.set_xlabel("seconds since the cell started", fontsize=7)
    for j in range(len(ranks), rows * cols):
        for k in range(per_rank):
            axes[j // cols * per_rank + k][j % cols].set_visible(False)
    axes[0][0].set_ylabel(unit, fontsize=8)
    if handles:
        fig.legend(list(handles.values()), list(handles), fontsize=6, loc="outside lower center",
                   ncols=min(len(handles), 4), frameon=False)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
