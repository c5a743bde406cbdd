"""Shared test setup: real ipyparallel clusters of CPU engines with gloo."""

from __future__ import annotations

import os
from pathlib import Path

# Engines inherit the environment of the process that starts them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))
