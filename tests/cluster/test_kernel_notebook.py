"""`%%distributed` in a real Jupyter kernel (nbclient): what the notebook receives, and Run All stopping."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from mpnb.execution.output import strip_ansi

pytestmark = pytest.mark.timeout(300)


def _text(outputs: list) -> str:
    parts = []
    for out in outputs:
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return strip_ansi("".join(parts))


def test_a_notebook_run_streams_grouped_output_and_stops_at_a_failed_cell():
    cells = [
        "%load_ext mpnb",
        "%mpnb start -n 2 --timeout 30",
        "%%distributed\nprint('hello from', world_size, 'ranks')\nrank * 10",
        "%%distributed\nx = 1\nif rank == 1:\n    x = x / 0",
        "print('this cell must not run')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=False)
    with client.setup_kernel():
        try:
            failed_at = None
            for index, cell in enumerate(nb.cells):
                try:
                    client.execute_cell(cell, index)
                except CellExecutionError:
                    failed_at = index
                    break  # what Run All does on an error reply
        finally:
            stop = nbformat.v4.new_code_cell("%mpnb stop")
            nb.cells.append(stop)
            client.execute_cell(stop, len(nb.cells) - 1)
    assert "mpnb: 2 ranks ready" in _text(nb.cells[1].outputs)
    hello = _text(nb.cells[2].outputs)
    assert "[ranks 0,1] hello from 2 ranks" in hello
    assert "[rank 0] 0" in hello and "[rank 1] 10" in hello  # Out[...] collapsed per distinct value

    assert failed_at == 3  # the failing cell answered with an error status
    error = _text(nb.cells[3].outputs)
    assert "[rank 1] ZeroDivisionError: division by zero" in error
    assert "----> 4     x = x / 0" in error  # the notebook's own line number
    assert "CompositeError" not in error and "The cell failed on rank 1; rank 0 finished." in error
    assert nb.cells[4].outputs == []
    assert "cluster stopped" in _text(stop.outputs)
