"""Pipeline schedules drawn from measured intervals (kernel side: plain data in, matplotlib out).

The intervals come from `mpnb.engine.teaching.StageTimer` on each rank, pulled
into the notebook: `{stage: [(kind, microbatch, start, end), ...]}`, kind "F"
(forward) or "B" (backward), times in seconds on one axis (`sync_clock`).
`bubble_table` says how long each stage sat idle; `draw_timeline` draws them.
"""

from __future__ import annotations

from typing import Any

Events = dict[int, list[tuple[str, int, float, float]]]  # stage -> (kind, microbatch, start, end)


def bubble_table(events: Events) -> list[dict[str, Any]]:
    """Per stage: busy and idle seconds between the first start and the last end of any stage."""
    starts = [e[2] for evs in events.values() for e in evs]
    ends = [e[3] for evs in events.values() for e in evs]
    if not starts:
        return []
    span = max(ends) - min(starts)
    rows = []
    for stage, evs in sorted(events.items()):
        busy = sum(e[3] - e[2] for e in evs)
        idle = span - busy
        rows.append({"stage": stage, "busy s": busy, "idle s": idle, "idle %": 100 * idle / span})
    return rows


def draw_timeline(events: Events, ax: Any = None, title: str = "") -> Any:
    """Draw one row per stage, a box per forward (blue) / backward (orange) labelled by microbatch."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len(events)))
    t0 = min((e[2] for evs in events.values() for e in evs), default=0.0)
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for stage, evs in events.items():
        for kind, mb, start, end in evs:
            ax.barh(stage, (end - start) * 1000, left=(start - t0) * 1000, height=0.7,
                    color=colors[kind], edgecolor="white")
            ax.text((start - t0 + (end - start) / 2) * 1000, stage, f"{kind}{mb}", ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(sorted(events), [f"stage {s}" for s in sorted(events)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    if title:
        ax.set_title(title, fontsize=10)
    return ax
