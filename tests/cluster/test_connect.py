"""`%mpnb connect` to a cluster started by `ipcluster start` outside the notebook."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import mpnb
from mpnb.cluster.session import current
from mpnb.errors import ClusterError
from tests.helpers import run

pytestmark = pytest.mark.timeout(300)

CLUSTER_ID = "mpnbtest"


@pytest.fixture(scope="module")
def ipcluster(tmp_path_factory):
    """`ipcluster start -n 2` in its own IPython dir; yields the profile directory; stops it after."""
    ipython_dir = tmp_path_factory.mktemp("ipython")
    profile_dir = Path(ipython_dir) / "profile_mpnbtest"
    env = dict(os.environ, IPYTHONDIR=str(ipython_dir))
    ipcluster_cmd = [sys.executable, "-m", "ipyparallel.apps.ipclusterapp"]
    proc = subprocess.Popen(
        [*ipcluster_cmd, "start", "-n", "2", "--profile=mpnbtest", f"--cluster-id={CLUSTER_ID}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        connection = profile_dir / "security" / f"ipcontroller-{CLUSTER_ID}-client.json"
        deadline = time.monotonic() + 120
        while not connection.exists():
            assert proc.poll() is None, "ipcluster exited early"
            assert time.monotonic() < deadline, "ipcluster did not write its connection file"
            time.sleep(0.2)
        yield profile_dir
    finally:
        mpnb.stop()
        subprocess.run(
            [*ipcluster_cmd, "stop", "--profile=mpnbtest", f"--cluster-id={CLUSTER_ID}"],
            env=env,
            timeout=60,
            capture_output=True,
        )
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait(10)


@pytest.fixture(autouse=True)
def _disconnect_after_each_test():
    """A test that fails while connected must not leave its session to the next one."""
    yield
    mpnb.stop()


def test_connect_forms_a_world_and_stop_only_disconnects(ipython, ipcluster):
    ip = ipython
    res, out = run(ip, f"%mpnb connect --profile {ipcluster} --cluster-id {CLUSTER_ID} --timeout 30")
    assert res.success, out
    assert out.strip().startswith("mpnb: 2 ranks ready")
    sess = mpnb.session()
    assert sess.cluster is None and sess.world_size == 2

    res, out = run(
        ip,
        "%%distributed\nimport os\nt = torch.tensor([float(rank)])\ndist.all_reduce(t)\n"
        "print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], t.item())\n",
    )
    assert res.success, out
    assert "[rank 0] 0 0 2 1.0" in out and "[rank 1] 1 1 2 1.0" in out

    res, out = run(ip, "%mpnb restart")
    assert not res.success and "cannot restart" in out and "%mpnb connect" in out

    res, out = run(ip, "%mpnb stop")
    assert res.success and "disconnected" in out and current() is None
    # the external cluster keeps running: its engines are still alive and can be connected again
    pids = {r.pid for r in sess.ranks}
    assert all(psutil.pid_exists(pid) for pid in pids)
    again = mpnb.connect(str(ipcluster), CLUSTER_ID, timeout=30, verbose=False)
    try:
        assert {r.pid for r in again.ranks} == pids
        res, out = run(ip, "%%distributed\nprint(dist.get_world_size())\n")
        assert out.strip() == "[ranks 0,1] 2"
    finally:
        mpnb.stop()


def test_connect_to_a_missing_cluster_names_the_ones_that_exist(ipython, ipcluster):
    res, out = run(ipython, f"%mpnb connect --profile {ipcluster} --cluster-id nosuchcluster")
    assert not res.success and isinstance(res.error_in_exec, ClusterError)
    assert "No ipyparallel cluster with id nosuchcluster" in out
    assert CLUSTER_ID in out and "ipcluster start" in out
    assert current() is None
