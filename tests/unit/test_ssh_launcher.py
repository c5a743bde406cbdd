"""`mpnb.cluster.ssh_launcher`: ipyparallel's SSH engine launcher with the engines' starts side by side.

The ssh command is a shell script standing in for an ssh that takes 2 s and then fails to log in, so
the test sees when each engine's first ssh call began and ended (the real SSH path, on simulated
hosts with an sshd each, is tests/cluster/test_ssh_hosts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpnb.cluster.ssh_launcher import ParallelSSHEngineSetLauncher

SLOW_FAILING_SSH = (
    'echo "start $(date +%s.%N)" >> {log}; sleep 2; echo "end $(date +%s.%N)" >> {log}; exit 255'
)


def test_every_engine_starts_at_once_and_a_failure_is_raised(tmp_path: Path) -> None:
    log = tmp_path / "ssh-calls.log"
    launcher = ParallelSSHEngineSetLauncher(
        engines={"host-a": 2, "host-b": 2},
        ssh_cmd=["sh", "-c", SLOW_FAILING_SSH.format(log=log), "ssh"],
        profile_dir=str(tmp_path / "profile"),
        cluster_id="test",
    )
    with pytest.raises(Exception, match="Unable to get remote shell information"):
        launcher.start(4)
    calls = [line.split() for line in log.read_text().splitlines()]
    starts = [float(t) for what, t in calls if what == "start"]
    ends = [float(t) for what, t in calls if what == "end"]
    assert len(starts) == len(ends) == 4, calls  # each engine tried; none was skipped after a failure
    assert max(starts) < min(ends), calls  # one after another, each would begin after the last ended
    assert launcher.start_pool is None
