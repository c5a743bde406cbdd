"""The teaching notebooks' import path: `from mpnb.teaching import StageTimer, draw_timeline, ...`.

The notebooks are public API, so this name stays while the tools live in two
halves: the engine half (`mpnb.engine.teaching`: `SavedTensorMeter`,
`LiveActivationMeter`, `gathered_parameter_bytes`, `StageTimer`, `sync_clock`,
`pipeline_steps`, and `count_collectives` from `mpnb.engine.comm_count`; torch imported when called) and the
kernel half (`mpnb.widgets.timeline`: `bubble_table`, `idle_share`,
`formula_bubble`, `expected_bubble`, `draw_timeline`; matplotlib, no torch). Names load on first
use, so an engine cell that imports a meter does not import the widgets, and
the kernel drawing a timeline does not import the meters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpnb.lazy_exports import lazy_exports

_HALVES: dict[str, str] = {
    "SavedTensorMeter": "mpnb.engine.teaching",
    "gathered_parameter_bytes": "mpnb.engine.teaching",
    "LiveActivationMeter": "mpnb.engine.teaching",
    "StageTimer": "mpnb.engine.teaching",
    "pipeline_steps": "mpnb.engine.teaching",
    "sync_clock": "mpnb.engine.teaching",
    "count_collectives": "mpnb.engine.comm_count",
    "Events": "mpnb.widgets.timeline",
    "bubble_table": "mpnb.widgets.timeline",
    "draw_timeline": "mpnb.widgets.timeline",
    "expected_bubble": "mpnb.widgets.timeline",
    "formula_bubble": "mpnb.widgets.timeline",
    "idle_share": "mpnb.widgets.timeline",
}

__all__ = [
    "Events",
    "LiveActivationMeter",
    "SavedTensorMeter",
    "StageTimer",
    "bubble_table",
    "count_collectives",
    "draw_timeline",
    "expected_bubble",
    "formula_bubble",
    "gathered_parameter_bytes",
    "idle_share",
    "pipeline_steps",
    "sync_clock",
]


__getattr__, __dir__ = lazy_exports(__name__, _HALVES)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mpnb.engine.comm_count import count_collectives
    from mpnb.engine.teaching import (
        LiveActivationMeter,
        SavedTensorMeter,
        StageTimer,
        gathered_parameter_bytes,
        pipeline_steps,
        sync_clock,
    )
    from mpnb.widgets.timeline import (
        Events,
        bubble_table,
        draw_timeline,
        expected_bubble,
        formula_bubble,
        idle_share,
    )
