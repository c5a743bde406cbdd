"""Per-rank states of a cell run, and the one state the dashboard shows for the whole cell.

A rank goes running -> done | failed | stopped. The strings travel as they are
to the dashboard comm and the JupyterLab extension (`session.cell`).
"""

from __future__ import annotations

from collections.abc import Iterable

RUNNING, DONE, FAILED, STOPPED = "running", "done", "failed", "stopped"


def overall_state(states: Iterable[str], *, timed_out: bool, final: bool) -> str:
    """Running while any rank runs (unless final); else failed over stopped over done."""
    seen = set(states)
    if RUNNING in seen and not final:
        return RUNNING
    if FAILED in seen or timed_out:
        return FAILED
    if STOPPED in seen:
        return STOPPED
    return DONE
