"""The detached nanny reaper kills a nanny only after its engine is gone (real processes, no cluster)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from mpnb.cluster import reaper as nanny_reaper

# An "engine" that starts a long-lived child whose command line marks it as a nanny, prints its pid.
ENGINE = (
    "import subprocess, sys, time\n"
    "sleeper = [sys.executable, '-c', 'import time; time.sleep(60)', 'ipyparallel.engine.nanny']\n"
    "nanny = subprocess.Popen(sleeper)\n"
    "print(nanny.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_nanny_is_killed_only_after_its_engine_is_gone():
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True)
    nanny = int(engine.stdout.readline())
    try:
        # engine alive: the nanny is left alone
        assert nanny_reaper.reap([(engine.pid, nanny)], grace=0.3, watch=1.5) == []
        assert psutil.pid_exists(nanny)
        # engine gone, nanny left behind (as a hung one would be): killed after the grace
        engine.kill()
        engine.wait(10)
        t0 = time.monotonic()
        assert nanny_reaper.reap([(engine.pid, nanny)], grace=0.5, watch=10) == [nanny]
        assert 0.5 <= time.monotonic() - t0 < 5
        assert not psutil.pid_exists(nanny) or psutil.Process(nanny).status() == psutil.STATUS_ZOMBIE
    finally:
        engine.kill()
        if psutil.pid_exists(nanny):
            psutil.Process(nanny).kill()


def test_a_process_that_is_not_a_nanny_is_never_touched():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert nanny_reaper.reap([(999_999_999, other.pid)], grace=0.1, watch=1) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(10)


def test_the_script_runs_detached_without_importing_mpnb():
    script = Path(nanny_reaper.__file__)
    t0 = time.monotonic()
    command = [sys.executable, "-X", "importtime", str(script), "1:999999999"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and time.monotonic() - t0 < 10  # the starter returns at once
    assert "mpnb" not in result.stderr and "torch" not in result.stderr
