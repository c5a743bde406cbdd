"""Pipeline schedules drawn from measured intervals (kernel side: plain data in, matplotlib out).

The intervals come from `mpnb.engine.teaching.StageTimer` on each rank, pulled
into the notebook: `{stage: [(kind, microbatch, start, end), ...]}`, kind "F"
(forward) or "B" (backward), times in seconds on one axis (`sync_clock`).
`bubble_table` says how long each stage sat idle, `idle_share` averages it over
stages, `formula_bubble` and `expected_bubble` predict it (equal stages, and from
each stage's measured time per microbatch); `draw_timeline` draws them.
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


def idle_share(events: Events) -> float:
    """Idle share of the step, averaged over stages (0..1): the measured bubble."""
    rows = bubble_table(events)
    return sum(r["idle %"] for r in rows) / len(rows) / 100 if rows else 0.0


def formula_bubble(stages: int, microbatches: int) -> float:
    """(p - 1) / (m + p - 1): the bubble with equal stages and free communication (GPipe and 1F1B alike)."""
    return (stages - 1) / (microbatches + stages - 1)


def expected_bubble(events: Events) -> float:
    """The bubble predicted from each stage's measured busy time per microbatch, stages unequal.

    With t_s seconds of work per microbatch on stage s, the step lasts about
    sum(t_s) + (m - 1)·max(t_s): the slowest stage sets the pace and the
    others wait for it. Equal t_s gives `formula_bubble`. What the measured
    idle share exceeds this by is the cost of moving activations and of the
    work outside the timed boxes (the loss, the schedule's own bookkeeping).
    """
    per_mb: dict[int, tuple[float, int]] = {}
    for stage, evs in events.items():
        m = len({e[1] for e in evs})
        if m:
            per_mb[stage] = (sum(e[3] - e[2] for e in evs) / m, m)
    if not per_mb:
        return 0.0
    m = max(n for _, n in per_mb.values())
    times = [t for t, _ in per_mb.values()]
    span = sum(times) + (m - 1) * max(times)
    return sum(1 - m * t / span for t in times) / len(times)


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
