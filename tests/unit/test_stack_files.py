"""Each engine's stack-dump file is named by pid and start time, and a starting engine sweeps the files
of engines that are gone: a pid that comes round again never finds a dead engine's file (real files)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpnb import private_files
from mpnb.cluster.reaper import start_ticks
from mpnb.engine import control

pytestmark = pytest.mark.skipif(start_ticks(os.getpid()) is None, reason="start times come from Linux /proc")


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "private"
    home.mkdir(mode=0o700)
    monkeypatch.setattr(private_files, "_cached", (os.getpid(), home))
    return home


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def make(home, name: str) -> str:
    path = home / name
    path.write_text("Current thread 0x0 (most recent call first):\n")
    path.chmod(0o600)
    return name


def test_the_path_names_this_process_by_pid_and_start_time(home):
    assert control.stack_path() == str(home / f"stacks-{os.getpid()}-{start_ticks(os.getpid())}.txt")


def test_files_of_gone_engines_are_swept_and_live_ones_kept(home):
    me, ticks, dead = os.getpid(), start_ticks(os.getpid()), dead_pid()
    live = {make(home, name) for name in (f"stacks-{me}-{ticks}.txt", f"stacks-{me}.txt", "engine-1.log")}
    gone = {
        make(home, f"stacks-{dead}-{ticks}.txt"),  # the process is gone
        make(home, f"stacks-{me}-{ticks + 1}.txt"),  # its pid now names another process
        make(home, f"stacks-{dead}.txt"),  # the name engines used before, its process gone
    }
    removed = control.sweep_dead_stack_files()
    assert sorted(os.path.basename(p) for p in removed) == sorted(gone)
    assert set(os.listdir(home)) == live  # engine logs stay: the sidebar links a dead engine's log


def test_a_symlink_is_left_alone_by_the_sweep(home, tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep me\n")
    (home / f"stacks-{dead_pid()}-1.txt").symlink_to(target)
    assert control.sweep_dead_stack_files() == []
    assert target.read_text() == "keep me\n"
