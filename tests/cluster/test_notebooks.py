"""Every teaching notebook runs top to bottom in a real kernel, on the 2-rank CPU cluster it starts.

Each notebook is executed headlessly (nbclient, python3 kernel from this venv).
A test fails on any cell error, when the cell tagged `result` (the measured
result the notebook ends with) has no table or figure, or when processes the
kernel started outlive it (the notebook must `%mpnb stop` its cluster).
`mpnb.tools.demo` kills such leftovers by pid either way. Notebooks are committed
without outputs; `make demo` writes an executed copy of the quickstart.
"""

from __future__ import annotations

import struct
from pathlib import Path

import nbformat
import pytest

from mpnb.tools.demo import NOTEBOOKS, PNG_MAGIC, QUICKSTART, execute_notebook, run_demo
from tests.helpers import code_cells, result_cells

NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(600)


def _has_table_or_figure(cell: nbformat.NotebookNode) -> bool:
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if "image/png" in data or "<table" in str(data.get("text/html", "")):
            return True
    return False


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == PNG_MAGIC, "not a PNG"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk follows the signature
    return width, height


def _check_executed(nb: nbformat.NotebookNode, run_error: BaseException | None, leftovers: list[str]) -> None:
    assert run_error is None, f"the notebook failed:\n{run_error}"
    codes = code_cells(nb)
    assert all(c.get("execution_count") for c in codes), "some code cells did not run"
    results = result_cells(nb)
    assert results, "no code cell is tagged 'result' (the measured result the notebook ends with)"
    final = results[-1]
    assert _has_table_or_figure(final), f"the result cell shows no table or figure:\n{final.source}"
    # After the result only the cluster is stopped: the notebook ends with its measurement.
    after = codes[codes.index(final) + 1:]
    assert [c.source.strip() for c in after] == ["%mpnb stop"], (
        f"the result cell must be followed only by `%mpnb stop`, found {[c.source for c in after]}"
    )
    stop_text = "".join(o.get("text", "") for o in after[0].outputs if o.output_type == "stream")
    assert "cluster stopped" in stop_text
    # An engine's nanny can outlive its stopped engine by seconds on a loaded machine (it tells the
    # controller, with a 3 s linger); engines or a controller still running mean the cluster was not stopped.
    running = [p for p in leftovers if "engine.nanny" not in p]
    assert not running, f"processes outlived the notebook's kernel (killed now): {running}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict | Exception]:
    """`make demo`'s function, run once: the quickstart executed into a temporary directory."""
    out = tmp_path_factory.mktemp("demo")
    try:
        return out, run_demo(out, timeout=CELL_TIMEOUT_S)
    except RuntimeError as exc:
        return out, exc


def test_demo_writes_executed_quickstart_and_memory_png(demo: tuple[Path, dict | Exception]) -> None:
    out, result = demo
    assert not isinstance(result, Exception), str(result)
    assert result["notebook"] == out / QUICKSTART.name
    nb = nbformat.read(result["notebook"], as_version=4)
    assert all(c.get("execution_count") for c in code_cells(nb))
    png = result["memory_chart"].read_bytes()
    width, height = _png_size(png)
    assert width >= 300 and height >= 150, (width, height)
    # A real chart, not a blank canvas: decode it and check it has many distinct colours.
    import matplotlib.image

    pixels = matplotlib.image.imread(result["memory_chart"])
    distinct = {tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[:: 7].tolist()}
    assert len(distinct) > 20, f"the PNG has only {len(distinct)} colours"


@pytest.mark.parametrize("path", NOTEBOOK_PATHS, ids=[p.stem for p in NOTEBOOK_PATHS])
def test_notebook_runs_and_ends_with_a_measurement(path: Path, request: pytest.FixtureRequest) -> None:
    if path == QUICKSTART:  # executed once by the demo fixture; check that run instead of repeating it
        _out, result = request.getfixturevalue("demo")
        assert not isinstance(result, Exception), str(result)
        run = result["run"]
    else:
        run = execute_notebook(path, timeout=CELL_TIMEOUT_S)
    _check_executed(run.nb, run.error, run.leftovers)
