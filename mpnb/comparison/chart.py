"""The comparison's bar chart: memory stacked by category, step time, bytes sent per step, per config.

Drawn with matplotlib into a PNG that stays in the notebook. Memory and bytes
are the busiest rank's (the one that decides whether a config fits and how
long a collective takes); the estimator's predictions are black ticks.
"""

from __future__ import annotations

import io

from mpnb.comparison.result import MEMORY_CATEGORIES, Comparison
from mpnb.monitoring.chart_image import COLORS, scale_unit

KIND_COLORS = {"all_reduce": "#4e79a7", "all_gather": "#59a14f", "reduce_scatter": "#f28e2b",
               "send": "#b07aa1", "recv": "#d4a6c8", "broadcast": "#9c755f"}
OTHER_COLOR = "#bab0ac"
HEADROOM = 1.45  # the y axis reaches this times the tallest bar: the legend sits above the bars


def render_png(result: Comparison) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = result.measured()
    labels = [r.label for r in runs]
    x = range(len(runs))
    fig = Figure(figsize=(11, 3.8), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    mem_ax, time_ax, comm_ax = fig.subplots(1, 3)

    busiest = [r.busiest() for r in runs]
    top = max([r.memory(b) for r, b in zip(runs, busiest, strict=True)]
              + [(b.get("estimate") or {}).get("total", 0) for b in busiest] + [1])
    scale, unit = scale_unit(top)
    bottom = [0.0] * len(runs)
    for cat in MEMORY_CATEGORIES:
        values = [(b.get("memory") or {}).get(cat, 0) / scale for b in busiest]
        color = COLORS.get(cat, COLORS["other"])
        mem_ax.bar(x, values, bottom=bottom, color=color, label=cat)
        bottom = [a + v for a, v in zip(bottom, values, strict=True)]
    predicted = [(b.get("estimate") or {}).get("total") for b in busiest]
    mem_ax.scatter([i for i, p in zip(x, predicted, strict=True) if p],
                   [p / scale for p in predicted if p], marker="_", s=400, color="black", label="predicted")
    mem_ax.set_title(f"memory, busiest rank ({unit})", fontsize=9)
    mem_ax.set_ylim(0, top / scale * HEADROOM)

    times = [r.step_time() * 1e3 for r in runs]
    slowest = [r.slowest()["times"] for r in runs]
    spread = [[t - min(s) * 1e3 for s, t in zip(slowest, times, strict=True)],
              [max(s) * 1e3 - t for s, t in zip(slowest, times, strict=True)]]
    time_ax.bar(x, times, color="#76b7b2", yerr=spread, capsize=3)
    time_ax.set_title("step time (ms, median, min-max)", fontsize=9)

    kinds = sorted({k for b in busiest for k in b["comm"]})
    ctop = max([sum(k["bytes"] for k in b["comm"].values()) for b in busiest] + [1])
    cscale, cunit = scale_unit(ctop)
    bottom = [0.0] * len(runs)
    for kind in kinds:
        values = [b["comm"].get(kind, {}).get("bytes", 0) / cscale for b in busiest]
        comm_ax.bar(x, values, bottom=bottom, color=KIND_COLORS.get(kind, OTHER_COLOR), label=kind)
        bottom = [a + v for a, v in zip(bottom, values, strict=True)]
    comm_ax.set_title(f"sent per step ({cunit})", fontsize=9)
    comm_ax.set_ylim(0, ctop / cscale * HEADROOM)
    for ax in (mem_ax, time_ax, comm_ax):
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    for ax in (mem_ax, comm_ax):  # in the headroom above the bars, so none hides under it
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper center", ncol=3, frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def show_chart(result: Comparison) -> None:
    from IPython.display import Image, display

    display(Image(data=render_png(result), format="png"))
