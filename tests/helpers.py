"""Shared by unit and cluster tests: run a cell in a real shell, watch child processes, read notebooks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import nbformat
import psutil
from IPython.utils.capture import capture_output

from mpnb.errors import MpnbError
from mpnb.execution.output import strip_ansi

if TYPE_CHECKING:
    from mpnb.cluster.session import Session

# torch's own teardown of a gloo worker under torchrun aborts now and then after the script's last line
# (4 launches in 40 of notebook 08's DDP script here, `destroy_process_group()` called): the script's
# stdout is complete, and torchrun exits 1 with this on its stderr.
TORCHRUN_TEARDOWN_ABORT = "terminate called without an active exception"


def run(ip, source: str):
    """Run one cell in shell `ip`; return (result, stdout without colours)."""
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout)


def both(out: str, text: str) -> bool:
    """Both ranks printed `text`: as one merged "[ranks 0,1]" line, or one line each when they arrived
    too far apart to merge (live output merges lines that come in together)."""
    return f"[ranks 0,1] {text}" in out or (f"[rank 0] {text}" in out and f"[rank 1] {text}" in out)


def expect_error(ip, line: str, error: type[MpnbError], *phrases: str) -> str:
    """Run `line`, assert it failed with `error` as one short message naming every phrase; return the text."""
    res, out = run(ip, line)
    assert not res.success, line
    assert isinstance(res.error_in_exec, error), (line, res.error_in_exec)
    for phrase in phrases:
        assert phrase in out, (line, phrase, out)
    assert "Traceback" not in out  # one short message, not a traceback
    return out


def children() -> set[int]:
    """Pids of this process's live descendants."""
    return {
        p.pid for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"
    }


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code"]


def result_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    """The cells a notebook tags `result`: where it shows its measured lesson."""
    return [c for c in code_cells(nb) if "result" in c.metadata.get("tags", [])]


@contextlib.contextmanager
def own_cluster(n: int = 2, timeout: float = 30) -> Iterator[Session]:
    """A fresh n-engine CPU session (gloo, process-group `timeout` s), stopped afterwards.

    Any session a previous module left is stopped first, so none leaks into the next."""
    import mpnb

    mpnb.stop()
    sess = mpnb.start(n=n, timeout=timeout, verbose=False)
    try:
        yield sess
    finally:
        mpnb.stop()


class RecordingComm:
    """The frontend's end of one comm: keeps what the kernel sent."""

    comm_id = "recording"

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, data: dict[str, Any]) -> None:
        self.sent.append(data)

    def on_msg(self, _callback: Any) -> None:
        pass

    def on_close(self, _callback: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def cells(self) -> list[dict[str, Any]]:
        return [m["cell"] for m in self.sent if m.get("type") == "state" and m.get("cell")]

    def alive(self) -> list[tuple[str | None, dict[int, bool]]]:
        """Each `state` message with a cluster: (the cell's status, rank -> alive)."""
        return [((m.get("cell") or {}).get("status"), {r["rank"]: r["alive"] for r in m["cluster"]["ranks"]})
                for m in self.sent if m.get("type") == "state" and m.get("cluster")]
