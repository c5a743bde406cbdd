"""`traceback_warmup.warm` leaves behind what a rank's first traceback would otherwise compute."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter: this test process may have formatted tracebacks already.
CHECK = """
import inspect
import torch.distributed
from stack_data.core import Source
from torch.distributed import distributed_c10d
from mpnb.engine import traceback_warmup

source = Source.for_filename(distributed_c10d.__file__)
assert "pieces" not in vars(source) and source._asttext is None
traceback_warmup.warm()
assert "pieces" in vars(source) and source._asttext is not None, "torch.distributed's source not split"
assert inspect.modulesbyfile.get(inspect.getabsfile(distributed_c10d)) == distributed_c10d.__name__
print("warm")
"""


def test_warm_splits_torch_distributed_sources_and_fills_inspect_module_cache():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "warm", done.stderr
