"""`%mpnb connect` waits for as many engines as the cluster file says were launched: read from the
file ipyparallel itself writes, without rebuilding its launchers (a rebuilt SSH launcher starts a
thread per engine that logs in to the engine's host every few seconds, for as long as the kernel runs)."""

from __future__ import annotations

import threading

import ipyparallel as ipp
from ipyparallel.cluster.launcher import SSHEngineLauncher

from mpnb.cluster.launch import expected_engines


def write_ssh_cluster_file(profile_dir: str, engines: int) -> None:
    """What `ipcluster start --engines=ssh` leaves in the profile: a running SSH engine set."""
    cluster = ipp.Cluster(profile_dir=profile_dir, cluster_id="c", engine_launcher_class="ssh", n=engines,
                          shutdown_atexit=False)
    engine_set = cluster.engine_launcher_class(parent=cluster, profile_dir=profile_dir, cluster_id="c")
    engine_set.n, engine_set.state = engines, "running"
    for i in range(engines):
        launcher = SSHEngineLauncher(parent=engine_set, profile_dir=profile_dir, cluster_id="c",
                                     hostname="node.invalid", user="root")
        launcher.pid, launcher.state = 1000 + i, "running"
        engine_set.launchers[str(i)] = launcher
    cluster.engines["set"] = engine_set
    cluster.write_cluster_file()


def test_the_count_comes_from_the_file_and_no_launcher_thread_starts(tmp_path):
    (tmp_path / "security").mkdir()
    write_ssh_cluster_file(str(tmp_path), 3)
    threads = set(threading.enumerate())
    assert expected_engines({"profile_dir": str(tmp_path)}, "c") == 3
    assert set(threading.enumerate()) == threads


def test_no_file_or_a_broken_one_counts_zero(tmp_path):
    (tmp_path / "security").mkdir()
    assert expected_engines({"profile_dir": str(tmp_path)}, "c") == 0
    (tmp_path / "security" / "cluster-c.json").write_text("{")
    assert expected_engines({"profile_dir": str(tmp_path)}, "c") == 0
