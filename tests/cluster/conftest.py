"""Fixtures for tests that start real ipyparallel engines; every test here carries the `cluster` marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import own_cluster

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The hook sees the whole session's items: mark only the ones collected from this folder,
    # so that `pytest -m "not cluster"` is exactly tests/unit.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="module")
def cluster():
    """A started 2-engine CPU Session (gloo), shared by the tests of one module and stopped after them."""
    with own_cluster(timeout=30) as sess:
        yield sess


@pytest.fixture(scope="module")
def view(cluster):
    """A view on every rank of `cluster` with tests/cluster/strategy_runs.py's engine functions installed."""
    from .strategy_runs import install

    v = cluster.view()
    install(v)
    return v
