"""Stacked per-rank memory bars as plain HTML, for the config panel.

HTML with inline styles redraws instantly inside an `ipywidgets.HTML` and needs
no front-end code or matplotlib. Every element has a stable `mpnb-panel-*`
class and `data-*` attributes (bytes as ints) so browser tests can read the
numbers back.
"""

from __future__ import annotations

import html

from mpnb.planning.estimator import Estimate, RankEstimate
from mpnb.units import format_bytes

# category -> (label, colour); the same colours as the memory chart's categories where they overlap
CATEGORIES: dict[str, tuple[str, str]] = {
    "parameters": ("parameters", "#4c72b0"),
    "gradients": ("gradients", "#dd8452"),
    "optimizer": ("optimizer state", "#55a868"),
    "activations": ("activations", "#8172b3"),
    "buffers": ("buffers", "#937860"),
}


def rank_groups(est: Estimate) -> list[tuple[str, RankEstimate]]:
    """Ranks with identical numbers drawn as one bar: [("0-63", rank estimate), ...]."""
    groups: list[tuple[list[int], RankEstimate]] = []
    for r in est.ranks:
        key = (r.parameters, r.gradients, r.optimizer, r.activations, r.buffers, r.offloaded)
        for ranks, first in groups:
            if (first.parameters, first.gradients, first.optimizer, first.activations, first.buffers,
                    first.offloaded) == key:
                ranks.append(r.rank)
                break
        else:
            groups.append(([r.rank], r))
    return [(_rank_label(ranks), first) for ranks, first in groups]


def _rank_label(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


MODEL_STATES = ("parameters", "gradients", "optimizer")  # the ZeRO paper's model states
OTHER = ("activations", "buffers")  # what the paper's Figure 1 leaves out
CAPACITY_COLOUR = "#c44e52"


def legend(keys: tuple[str, ...] = tuple(CATEGORIES), *, capacity: bool = False) -> str:
    """Swatches for the categories `keys`, and the dashed capacity line when the bars draw it."""
    items = [
        f'<span class="mpnb-panel-legend-item" data-category="{key}" '
        'style="margin-right:10px;white-space:nowrap">'
        f'<span style="display:inline-block;width:10px;height:10px;background:{CATEGORIES[key][1]};'
        f'margin-right:4px;vertical-align:middle"></span>{CATEGORIES[key][0]}</span>'
        for key in keys
    ]
    if capacity:
        items.append(
            '<span class="mpnb-panel-legend-item" data-category="capacity" style="white-space:nowrap">'
            f'<span style="display:inline-block;width:0;height:12px;border-left:2px dashed {CAPACITY_COLOUR};'
            'margin:0 6px 0 4px;vertical-align:middle"></span>memory per rank (the dashed line)</span>'
        )
    return f'<div class="mpnb-panel-legend" style="font-size:11px;margin:4px 0">{"".join(items)}</div>'


def bar(label: str, r: RankEstimate, scale: float, capacity: int, *, kind: str = "rank",
        keys: tuple[str, ...] = tuple(CATEGORIES)) -> str:
    """One stacked bar of the categories `keys`: label, coloured segments, capacity marker, their sum."""
    segments = []
    for key in keys:
        name, colour = CATEGORIES[key]
        value = getattr(r, key)
        if value <= 0:
            continue
        width = 100.0 * value / scale
        tip = f"{name}: {format_bytes(value)} ({value:,} bytes)"
        segments.append(
            f'<div class="mpnb-panel-seg mpnb-panel-seg-{key}" data-bytes="{value}" '
            f'title="{html.escape(tip)}" '
            f'style="display:inline-block;height:100%;width:{width:.4f}%;background:{colour}"></div>'
        )
    marker = ""
    if capacity > 0:
        left = min(100.0, 100.0 * capacity / scale)
        marker = (
            f'<div class="mpnb-panel-capacity" data-bytes="{capacity}" '
            f'title="memory per rank {format_bytes(capacity)}" '
            f'style="position:absolute;top:-2px;bottom:-2px;left:{left:.4f}%;'
            f'border-left:2px dashed {CAPACITY_COLOUR}"></div>'
        )
    total = sum(getattr(r, key) for key in keys)
    fits = capacity <= 0 or total <= capacity
    offload = f" + {format_bytes(r.offloaded)} on CPU" if r.offloaded and "optimizer" in keys else ""
    total_style = "" if fits else f"color:{CAPACITY_COLOUR};font-weight:bold"
    return (
        f'<div class="mpnb-panel-row" data-{kind}="{html.escape(label)}" data-total="{total}" '
        f'data-fits="{str(fits).lower()}" '
        'style="display:flex;align-items:center;margin:3px 0;font-size:12px">'
        f'<div class="mpnb-panel-label" style="width:90px;flex:none">{html.escape(label)}</div>'
        f'<div class="mpnb-panel-bar" style="position:relative;flex:1;height:16px;background:#eee;'
        f'white-space:nowrap;overflow:visible">{"".join(segments)}{marker}</div>'
        f'<div class="mpnb-panel-total" style="width:150px;flex:none;text-align:right;{total_style}">'
        f"{format_bytes(total)}{offload}</div></div>"
    )


def estimate_html(est: Estimate, capacity: int) -> str:
    """Bars per rank group for one estimate, with a warning when a rank does not fit."""
    groups = rank_groups(est)
    scale = max([capacity * 1.05, *(r.total for _, r in groups), 1])
    rows = "".join(bar(f"rank {label}", r, scale, capacity) for label, r in groups)
    parts = [f'<div class="mpnb-panel-estimate-bars" data-total="{est.total}">',
             legend(capacity=capacity > 0), rows]
    if capacity > 0 and not est.fits(capacity):
        worst = est.worst
        parts.append(
            '<div class="mpnb-panel-warning" '
            'style="color:#c44e52;font-weight:bold;margin-top:4px;font-size:12px">'
            f"Does not fit: rank {worst.rank} needs {format_bytes(worst.total)} but the device has "
            f"{format_bytes(capacity)}. Try a higher ZeRO stage or FSDP, activation checkpointing, "
            "a smaller micro batch, offload, or more ranks.</div>"
        )
    elif capacity > 0:
        parts.append(
            '<div class="mpnb-panel-fits" style="color:#55a868;margin-top:4px;font-size:12px">'
            "Fits: the most loaded rank "
            f"uses {100 * est.total / capacity:.0f}% of {format_bytes(capacity)}.</div>"
        )
    formula = est.activation_formula
    for note in est.notes:
        title = ""
        if formula and note == f"activations: {formula}":  # a paragraph: one line here, whole on hover
            title = f' title="{html.escape(note)}"'
            note = f"activations: {formula.split(';')[0]} (hover: formula)"
        parts.append(
            f'<div class="mpnb-panel-note"{title} style="color:#777;font-size:11px">{html.escape(note)}</div>'
        )
    parts.append("</div>")
    return "".join(parts)
