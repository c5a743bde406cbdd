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
    started = nanny_reaper.start_time(psutil.Process(nanny))  # recorded when the world forms
    try:
        # engine alive: the nanny is left alone
        assert nanny_reaper.reap([(engine.pid, nanny, started)], grace=0.3, watch=1.5) == []
        assert psutil.pid_exists(nanny)
        # engine gone, nanny left behind (as a hung one would be): killed after the grace
        engine.kill()
        engine.wait(10)
        t0 = time.monotonic()
        assert nanny_reaper.reap([(engine.pid, nanny, started)], grace=0.5, watch=10) == [nanny]
        assert 0.5 <= time.monotonic() - t0 < 5
        assert not psutil.pid_exists(nanny) or psutil.Process(nanny).status() == psutil.STATUS_ZOMBIE
    finally:
        engine.kill()
        if psutil.pid_exists(nanny):
            psutil.Process(nanny).kill()


def test_a_process_that_is_not_a_nanny_is_never_touched():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = nanny_reaper.start_time(psutil.Process(other.pid))
        assert nanny_reaper.reap([(999_999_999, other.pid, started)], grace=0.1, watch=1) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(10)


def test_a_reused_nanny_pid_with_another_start_time_is_never_killed():
    """Our nanny died and another cluster's nanny got its pid: its parent lives, its start time differs."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)  # our engine, gone
    other_engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True)
    decoy = int(other_engine.stdout.readline())  # nanny-looking, with a live parent that is not ours
    recorded = nanny_reaper.start_time(psutil.Process(decoy)) - 100  # our nanny started earlier
    try:
        assert nanny_reaper.reap([(gone.pid, decoy, recorded)], grace=0.1, watch=1.5) == []
        assert psutil.Process(decoy).status() != psutil.STATUS_ZOMBIE
    finally:
        other_engine.kill()
        other_engine.wait(10)
        if psutil.pid_exists(decoy):
            psutil.Process(decoy).kill()


def test_start_time_is_fixed_for_a_process_and_differs_between_processes():
    me = psutil.Process()
    assert nanny_reaper.start_time(me) == nanny_reaper.start_time(psutil.Process(me.pid))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.05)
        assert nanny_reaper.start_time(psutil.Process(child.pid)) > nanny_reaper.start_time(me)
    finally:
        child.kill()
        child.wait(10)


def test_the_script_runs_detached_without_importing_mpnb():
    script = Path(nanny_reaper.__file__)
    t0 = time.monotonic()
    command = [sys.executable, "-X", "importtime", str(script), "1:999999999:12345.0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and time.monotonic() - t0 < 10  # the starter returns at once
    assert "mpnb" not in result.stderr and "torch" not in result.stderr
