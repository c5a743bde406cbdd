"""The dashboard's `state` message for a `%mpnb run` script: its label, and the notebook cell it belongs to.

A real IPython shell with `%load_ext mpnb` (so the dashboard's `pre_run_cell` hook sees each cell's
Jupyter id) and a real `Session` with no engines: cells publish states with `set_cell_state`, as
`mpnb.execution.cell_run` does, and a recording comm gets what a frontend would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mpnb.cluster import session as cluster
from mpnb.cluster.launch import WorldPlan
from mpnb.cluster.session import Session
from mpnb.monitoring import dashboard as dashboard_mod
from mpnb.planning.config import Config
from tests.helpers import RecordingComm


@pytest.fixture
def frontend(ipython: Any) -> Iterator[RecordingComm]:
    """A live session without engines, and a frontend connected to the kernel's dashboard."""
    sess = Session(None, None, WorldPlan(backend="gloo", timeout_s=60, port=None, devices=None), Config(),
                   "start")
    cluster.set_current(sess)
    dashboard = dashboard_mod.current()
    assert dashboard is not None
    comm = RecordingComm()
    dashboard.open_from_frontend(comm)
    yield comm
    dashboard._drop_comm(comm)
    sess.closed = True
    sess.notify("stop")
    cluster.release_current(sess)


def publish(ipython: Any, cell: dict[str, Any], cell_id: str | None) -> None:
    """Run a notebook cell (Jupyter id `cell_id`) that publishes `cell` as the running cell's state."""
    result = ipython.run_cell(f"import mpnb\nmpnb.session().set_cell_state({cell!r})", cell_id=cell_id)
    assert result.success, result.error_in_exec


def test_script_label_and_its_own_cell_reach_the_frontend(ipython: Any, frontend: RecordingComm) -> None:
    both = {"0": "running", "1": "running"}
    publish(ipython, {"id": "1", "status": "running", "ranks": both}, "nb-cell")
    publish(ipython, {"id": "1", "status": "done", "ranks": {"0": "done", "1": "done"}}, "nb-plain")
    publish(ipython, {"id": "2", "status": "running", "ranks": both, "label": "train.py"}, "nb-script")
    publish(ipython, {"id": "2", "status": "failed", "ranks": {"0": "failed", "1": "stopped"},
                      "label": "train.py"}, "nb-script")
    cells = frontend.cells()
    assert [(c["id"], c["status"], c.get("label"), c.get("notebook_cell_id")) for c in cells] == [
        ("1", "running", None, "nb-cell"),
        ("1", "done", None, "nb-cell"),  # still the cell that started it, not the one running now
        ("2", "running", "train.py", "nb-script"),  # the plain cell that ran the script
        ("2", "failed", "train.py", "nb-script"),
    ]
    assert cells[-1]["ranks"] == {"0": "failed", "1": "stopped"}
    assert "label" not in cells[0]


def test_untagged_cells_never_borrow_another_cells_id(ipython: Any, frontend: RecordingComm) -> None:
    publish(ipython, {"id": "3", "status": "running", "ranks": {"0": "running"}}, "nb-a")
    # A cell run without a Jupyter id (an old frontend): its state names no cell, not nb-a.
    publish(ipython, {"id": "4", "status": "running", "ranks": {"0": "running"}, "label": "x.py"}, None)
    assert frontend.cells()[-1]["label"] == "x.py"
    assert "notebook_cell_id" not in frontend.cells()[-1]
    # A state the dashboard first reads outside a cell change (set before `%load_ext mpnb`, say)
    # is not tied to whichever cell happens to run when a frontend connects.
    cluster.session().cell = {"id": "5", "status": "done", "ranks": {"0": "done"}, "label": 7}
    ipython.run_cell("x = 1", cell_id="nb-b")
    later = RecordingComm()
    dashboard = dashboard_mod.current()
    assert dashboard is not None
    dashboard.open_from_frontend(later)
    dashboard._drop_comm(later)
    state = later.cells()[0]
    assert state["id"] == "5" and "notebook_cell_id" not in state
    assert "label" not in state  # not a file name: dropped, the frontend shows a cell


def test_a_saved_checkpoint_reaches_the_frontend_in_the_next_state(frontend: RecordingComm) -> None:
    """The receiver thread stores a checkpoint; the flush after the next samples sends the list once."""
    import time

    from tests.helpers import wait_for

    sess = cluster.session()
    assert frontend.sent[0]["checkpoints"] == []  # the answer to the open: nothing saved yet
    sess.notify("start")  # as the lifecycle does once the world is formed: the dashboard follows it
    record = {"path": "/runs/step-4", "step": 4, "strategy": "fsdp", "label": "FSDP", "world_size": 2,
              "bytes": 2048, "seconds": 0.3, "t": time.time()}
    sess.memory.add_checkpoint(record)
    sample = {"rank": 0, "t": time.time(), "used": 1, "busy": False}
    sess.memory.add([sample])  # samples keep coming at >= 1 Hz; the dashboard looks then

    def lists() -> list[list[dict[str, Any]]]:
        return [m["checkpoints"] for m in frontend.sent if m.get("type") == "state"]

    assert wait_for(lambda: lists()[-1] == [record], 3), lists()
    sess.memory.add([{**sample, "t": time.time()}])
    time.sleep(0.6)  # two flushes: the unchanged list is not sent again
    assert sum(1 for listed in lists() if listed) == 1
