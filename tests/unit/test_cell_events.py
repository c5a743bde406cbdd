"""How a cell's event loop hands output over: at once, not at the next tick (`CellRun.drain_events`)."""

from __future__ import annotations

import queue
import time

from mpnb.execution.cell_run import CellRun
from mpnb.execution.states import RUNNING


def event_loop() -> tuple[CellRun, list[str]]:
    """A CellRun's event loop alone: one running rank, events recorded instead of rendered."""
    run = CellRun.__new__(CellRun)  # no session: drain_events needs only these
    run.status = {0: RUNNING}
    run._events = queue.Queue()
    handled: list[str] = []
    run._handle = lambda rank, kind, payload: handled.append(kind)  # type: ignore[method-assign]
    return run, handled


def test_output_returns_to_the_caller_at_once_so_it_is_shown_before_the_tick():
    run, handled = event_loop()
    run._events.put((0, "stream", {"name": "stdout", "text": "hello\n"}))
    t0 = time.monotonic()
    run.drain_events(5.0)
    assert handled == ["stream"]
    assert time.monotonic() - t0 < 1.0  # not the 5 s it was allowed


def test_other_events_wait_for_the_tick_and_a_burst_of_output_is_shown_together():
    run, handled = event_loop()
    run._events.put((0, "reply", None))  # not output: nothing to show, keep waiting
    t0 = time.monotonic()
    run.drain_events(0.3)
    assert handled == ["reply"] and time.monotonic() - t0 >= 0.3

    # a burst of output already queued is handed over in one call, as one flush
    for _ in range(100):
        run._events.put((0, "stream", {"name": "stdout", "text": "x"}))
    run.drain_events(5.0)
    assert handled.count("stream") == 100
