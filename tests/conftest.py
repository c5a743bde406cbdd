"""Setup shared by tests/unit and tests/cluster: the engine environment and a real IPython shell."""

from __future__ import annotations

import os
from pathlib import Path

# Engines inherit the environment of the process that starts them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))

import pytest

from mpnb.engine.ds_ops import use_own_ninja

# DeepSpeed's ops are built with the venv's ninja (`make install`); a subprocess that found another
# ninja first on PATH would take that build for stale and compile the op again (1-2 min).
use_own_ninja()


@pytest.fixture(scope="module")
def ipython():
    """A real IPython InteractiveShell with `%load_ext mpnb` done (no cluster of its own)."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    shell = start_ipython() or get_ipython()  # start_ipython returns None after the first module
    shell.run_line_magic("load_ext", "mpnb")
    yield shell
    shell.run_line_magic("unload_ext", "mpnb")



@pytest.fixture
def fake_gpus():
    """Two fake 80 GiB GPUs visible to the kernel (the engines' torch still has none)."""
    from mpnb.cluster import devices

    devices.set_probe(
        lambda: [devices.Gpu(0, "Fake H100", 80 * 2**30), devices.Gpu(1, "Fake H100", 80 * 2**30)]
    )
    yield
    devices.set_probe(None)


@pytest.fixture
def no_leftover_session():
    """No session before or after the test (for modules that start and stop their own)."""
    import mpnb

    mpnb.stop()
    yield
    mpnb.stop()
