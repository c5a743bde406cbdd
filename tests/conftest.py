"""Shared test setup: real ipyparallel clusters of CPU engines with gloo."""

from __future__ import annotations

import os
from pathlib import Path

# Engines inherit the environment of the process that starts them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))

import pytest


@pytest.fixture(scope="module")
def cluster():
    """A started 2-engine CPU Session (gloo), shared by the tests of one module and stopped after them."""
    import mpnb
    from mpnb.cluster import session as cluster_mod

    cluster_mod.stop()  # a previous module's session must not leak into this one
    sess = mpnb.start(n=2, timeout=30, verbose=False)
    try:
        yield sess
    finally:
        cluster_mod.stop()


@pytest.fixture(scope="module")
def ipython():
    """A real IPython InteractiveShell with `%load_ext mpnb` done (no cluster of its own)."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()  # start_ipython returns None after the first module
    shell.run_line_magic("load_ext", "mpnb")
    yield shell
    shell.run_line_magic("unload_ext", "mpnb")


@pytest.fixture(scope="module")
def view(cluster):
    """A view on every rank of `cluster` with tests/strategy_runs.py's engine functions installed."""
    from strategy_runs import install

    v = cluster.view()
    install(v)
    return v
