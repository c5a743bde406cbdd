"""The teaching notebooks as committed: numbered, no outputs, a `result` cell, ending in `%mpnb stop`."""

from __future__ import annotations

import nbformat

from mpnb.tools.demo import NOTEBOOKS, QUICKSTART
from tests.helpers import code_cells, result_cells

NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_notebooks_exist_and_are_committed_without_outputs() -> None:
    names = [p.name[:2] for p in NOTEBOOK_PATHS]
    assert names == [f"{i:02d}" for i in range(1, len(names) + 1)], names
    assert QUICKSTART in NOTEBOOK_PATHS
    for path in NOTEBOOK_PATHS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in code_cells(nb):
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has committed outputs"
        assert result_cells(nb), f"{path.name}: no cell tagged 'result'"
        assert code_cells(nb)[-1].source.strip() == "%mpnb stop", f"{path.name} does not stop its cluster"
