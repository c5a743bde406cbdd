"""Launching a script with torchrun on 2 local processes, for the benchmarks that measure against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.helpers

from mpnb.engine.bootstrap import free_port
from tests.helpers import TORCHRUN_TEARDOWN_ABORT


@dataclass
class Launch:
    out: str  # stdout (with stderr, when asked)
    started: float  # time.time() just before the launch, to compare with times the script prints
    wall: float  # seconds from launch to exit
    returncode: int

    @property
    def completed(self) -> bool:
        """The script ran to its end: exit 0, or torch's teardown abort after it (`out` must hold
        stderr to tell)."""
        return self.returncode == 0 or TORCHRUN_TEARDOWN_ABORT in self.out


def torchrun(
    script: Path, args: Sequence[str] = (), stderr_too: bool = False, timeout: float = 300.0
) -> Launch:
    """`python -m torch.distributed.run --nproc_per_node 2 script args`, to its exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args]
    started, t0 = time.time(), time.perf_counter()
    # its own process group, so a timeout kills the workers too, not just the launcher
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_too else None,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return Launch(out, started, time.perf_counter() - t0, proc.returncode)
