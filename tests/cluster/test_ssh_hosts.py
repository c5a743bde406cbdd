"""`%mpnb start --ssh`: engines on two simulated hosts, started by ipyparallel's own SSH launcher
through an sshd on each host (`simulated_hosts.py`), as on real machines. Host names do not resolve
anywhere here, so the hosts are given by address.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from mpnb.cluster import session as cluster_session
from mpnb.errors import ClusterError, ConfigError
from mpnb.monitoring import dashboard
from tests.helpers import RecordingComm, expect_error, run, wait_for

from . import simulated_slurm
from .simulated_hosts import BRIDGE_ADDR, HOSTS, NET, pids_in, set_link, simulated_hosts, skip_reason
from .test_multinode import listening_addresses

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(skip_reason(sshd=True) is not None,
                       reason=f"SKIPPED LOUDLY: {skip_reason(sshd=True)}"),
]

WORLD = 2 * len(HOSTS)
ALL_REDUCE = "%%distributed\nt = torch.ones(1); dist.all_reduce(t); print(int(t.item()))\n"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with simulated_hosts(tmp_path_factory.mktemp("ssh"), engines_per_host=0, names_resolve=False,
                         sshd=True) as h:
        yield h


def spec(hosts, per_host: int = 2) -> str:
    return ",".join(f"root@{address}:{per_host}" for address in hosts.addresses.values())


def ssh_args(hosts) -> str:
    return " ".join(hosts.ssh_args)


DAEMONS = ("sshd", "slurmctld", "slurmd")  # the fixtures' own


def processes_on(host: str) -> dict[int, list[str]]:
    """Each process still running in the host's namespace but the fixtures' daemons, with its command line."""
    running = {}
    for pid in pids_in(host):
        with contextlib.suppress(psutil.NoSuchProcess):  # it may exit between the listing and this look
            process = psutil.Process(pid)
            if process.name() not in DAEMONS:
                running[pid] = process.cmdline()
    return running


def ssh_profile(hosts) -> list[str]:
    """ipyparallel's SSH engine launcher, set up as its docs show."""
    engines = {f"root@{address}": 2 for address in hosts.addresses.values()}
    return [
        "c.Cluster.engine_launcher_class = 'ssh'",
        f"c.SSHLauncher.ssh_args = {hosts.ssh_args!r}",
        f"c.SSHLauncher.remote_python = {sys.executable!r}",
        f"c.SSHEngineSetLauncher.engines = {engines!r}",
        "c.SSHEngineLauncher.to_send = []",  # the engines get the connection info in their environment
    ]


def mpi_profile(hosts) -> list[str]:
    """ipyparallel's MPI engine launcher: OpenMPI's mpiexec reaches both hosts through their sshd."""
    rsh = " ".join(["ssh", *hosts.ssh_args])
    mpi_args = [
        "--allow-run-as-root", "--host", ",".join(f"{a}:2" for a in hosts.addresses.values()),
        "--mca", "plm_rsh_agent", rsh,
        "--mca", "oob_tcp_if_include", f"{NET}.0/24", "--mca", "btl_tcp_if_include", f"{NET}.0/24",
        # without these the engines wait for a connection file that never comes
        "-x", "IPP_CONNECTION_INFO", "-x", "IPP_PROFILE_DIR", "-x", "IPP_CLUSTER_ID",
    ]
    return [
        "c.Cluster.engine_launcher_class = 'mpi'",
        f"c.MPILauncher.mpi_args = {mpi_args!r}",
    ]


def slurm_profile(hosts) -> list[str]:
    """ipyparallel's Slurm engine launcher with the README's batch job (but GPUs): 2 nodes x 2 tasks."""
    template = "\n".join([
        "#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}", "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2", "srun {program_and_args}", "",
    ])
    return ["c.Cluster.engine_launcher_class = 'slurm'",
            f"c.SlurmEngineSetLauncher.batch_template = {template!r}"]


PROFILES = {"ssh": ssh_profile, "mpi": mpi_profile, "slurm": slurm_profile}
NO_MPI = None if shutil.which("mpiexec") else "--engines=mpi needs mpiexec (Debian: openmpi-bin)"
NO_SLURM = simulated_slurm.skip_reason()
LAUNCHERS = ["ssh", *(
    pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=f"SKIPPED LOUDLY: {why}"))
    for name, why in (("mpi", NO_MPI), ("slurm", NO_SLURM))
)]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_connect_to_a_cluster_ipcluster_started_with_its_engine_launcher(ipython, hosts, tmp_path, launcher):
    """`ipcluster start` with its SSH, MPI or Slurm engine launcher, outside the notebook; then connect."""
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "ipcluster_config.py").write_text("\n".join([
        f"c.Cluster.controller_ip = {BRIDGE_ADDR!r}", f"c.Cluster.n = {WORLD}", *PROFILES[launcher](hosts),
    ]) + "\n")
    batch_system = simulated_slurm.simulated_slurm(tmp_path, hosts) if launcher == "slurm" else None
    with batch_system or contextlib.nullcontext() as env:  # Slurm's environment for sbatch; else None
        connect_and_run(ipython, profile, env)
    assert wait_for(lambda: not any(processes_on(h) for h in HOSTS), timeout=30), {
        h: processes_on(h) for h in HOSTS}


def connect_and_run(ipython, profile, env: dict[str, str] | None) -> None:
    """Start the cluster with ipcluster, connect, run a cell; ipcluster stops its engines after."""
    ipcluster = [sys.executable, "-m", "ipyparallel.cluster", "start", f"--profile-dir={profile}"]
    log = profile / "ipcluster.log"
    with open(log, "wb") as sink:
        # in the profile: the Slurm launcher writes its batch script, and Slurm the job's output, there
        launcher = subprocess.Popen(ipcluster, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=profile,
                                    start_new_session=True)
    try:
        assert wait_for(lambda: list(profile.glob("security/ipcontroller-*client.json")), timeout=60)
        res, out = run(ipython, f"%mpnb connect --profile {profile} --timeout 30")
        assert res.success and f"{WORLD} ranks on 2 hosts ready" in out, out + log.read_text()[-3000:]
        sess = cluster_session.current()
        assert [r.host for r in sess.ranks] == [h for h in sorted(HOSTS) for _ in range(2)]
        res, out = run(ipython, ALL_REDUCE)
        assert res.success and f"[ranks 0-{WORLD - 1}] {WORLD}" in out, out
        res, out = run(ipython, "%mpnb stop")
        assert "disconnected" in out and all(processes_on(h) for h in HOSTS), out  # left running
    finally:
        run(ipython, "%mpnb stop")
        subprocess.run([sys.executable, "-m", "ipyparallel.cluster", "stop", f"--profile-dir={profile}"],
                       capture_output=True, timeout=120, env=env, cwd=profile)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)


@pytest.fixture(scope="module")
def started(ipython, hosts):
    t0 = time.perf_counter()
    res, out = run(ipython, f"%mpnb start --ssh {spec(hosts)} --ssh-args '{ssh_args(hosts)}' --timeout 30")
    assert res.success, out
    seconds = time.perf_counter() - t0
    yield cluster_session.current(), out, seconds
    run(ipython, "%mpnb stop")


def test_a_login_that_fails_is_named_before_any_engine_starts(ipython, hosts):
    key_only = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]  # no key: refused
    out = expect_error(ipython, f"%mpnb start --ssh {spec(hosts)} --ssh-args '{' '.join(key_only)}'",
                       ClusterError, "No engine was started", "ssh could not log in",
                       *(f"root@{a}" for a in hosts.addresses.values()))
    assert "Permission denied" in out, out
    assert cluster_session.current() is None
    assert not any(processes_on(h) for h in HOSTS)


def test_a_python_without_mpnb_on_the_hosts_is_named(ipython, hosts):
    line = f"%mpnb start --ssh {spec(hosts)} --ssh-args '{ssh_args(hosts)}' --python /usr/bin/nope"
    expect_error(ipython, line, ClusterError, "there is no /usr/bin/nope", "--python")
    assert cluster_session.current() is None


def test_options_that_do_not_apply_to_ssh_are_refused(ipython, hosts):
    expect_error(ipython, f"%mpnb start --ssh {spec(hosts)} -n 4", ConfigError, "-n, --devices and --port")
    expect_error(ipython, "%mpnb start --python /usr/bin/python3", ConfigError, "add --ssh")
    expect_error(ipython, "%mpnb start --ssh nodeA:two", ConfigError, "whole number of engines")


def test_ssh_engines_form_one_world_grouped_by_host(ipython, hosts, started):
    sess, out, seconds = started
    assert f"{WORLD} ranks on 2 hosts ready" in out, out
    assert "Traceback" not in out and "scp" not in out, out
    assert [r.host for r in sess.ranks] == [h for h in sorted(HOSTS) for _ in range(2)]
    res, out = run(ipython, "%%distributed\nimport os\nt = torch.ones(1); dist.all_reduce(t)\n"
                            "print(int(t.item()), os.environ['MASTER_ADDR'], os.environ['GROUP_RANK'])\n")
    rank0_addr = hosts.addresses[sorted(HOSTS)[0]]
    assert res.success, out
    assert f"[ranks 0,1] {WORLD} {rank0_addr} 0" in out and f"[ranks 2,3] {WORLD} {rank0_addr} 1" in out, out
    assert seconds < 90, seconds


def test_the_controller_listens_on_the_address_the_hosts_reach_only(started):
    sess, _, _ = started
    controller = sess.cluster.controller.process.pid
    assert listening_addresses(controller) == {BRIDGE_ADDR}


LOOPING_ALL_REDUCES = (
    "%%distributed --no-monitor\nimport time\n"
    "for i in range(60):\n    t = torch.ones(1); dist.all_reduce(t); time.sleep(0.5)\n"
)


def test_a_host_that_drops_off_is_named_heal_goes_on_without_it_and_restart_brings_it_back(
        ipython, hosts, started):
    """Host B's link goes down while every rank loops over all_reduce: no process dies, nothing is
    said; before, the cell waited out gloo's timeout and the controller's (30 s each)."""
    sess, _, _ = started
    host_b = sorted(HOSTS)[1]
    sidebar = RecordingComm()
    dashboard.current().open_from_frontend(sidebar)
    timer = threading.Timer(3.0, set_link, (host_b, False))
    timer.start()
    t0 = time.perf_counter()
    try:
        res, out = run(ipython, LOOPING_ALL_REDUCES)
        ended_after_down = time.perf_counter() - t0 - 3.0
        assert type(res.error_in_exec).__name__ == "CellFailedError", out
        assert f"is unreachable: its host ({hosts.addresses[host_b]}) stopped answering" in out, out
        assert "The cell failed on ranks 2,3; ranks 0,1 interrupted by mpnb to free them." in out, out
        assert ended_after_down < 15, out  # measured 7 s; gloo's own timeout is 30 s
        res, out = run(ipython, "%mpnb status")
        alive = {line.split()[0]: line.split()[4] for line in out.splitlines()[2:]}
        assert alive == {"0": "True", "1": "True", "2": "False", "3": "False"}, out
        # the sidebar was told while the cell still ran, not only by the cell's end
        host_b_down = {0: True, 1: True, 2: False, 3: False}
        assert ("running", host_b_down) in sidebar.alive(), sidebar.alive()
        assert sidebar.alive()[-1][1] == host_b_down, sidebar.alive()
        t0 = time.perf_counter()
        res, out = run(ipython, "%mpnb heal")
        assert res.success and "rebuilt on 2 ranks (2 lost ranks left out)" in out, out
        assert time.perf_counter() - t0 < 5, out
        res, out = run(ipython, ALL_REDUCE)
        assert res.success and "[ranks 0,1] 2" in out, out
    finally:
        timer.join()
        set_link(host_b, True)
    before = {r.pid for r in sess.ranks}
    res, out = run(ipython, "%mpnb restart")
    assert res.success and f"{WORLD} ranks on 2 hosts ready" in out, out
    assert "Traceback" not in out and "exited during" not in out, out
    assert not before & {r.pid for r in sess.ranks}
    assert [r.host for r in sess.ranks] == [h for h in sorted(HOSTS) for _ in range(2)]
    res, out = run(ipython, ALL_REDUCE)
    assert res.success and f"[ranks 0-{WORLD - 1}] {WORLD}" in out, out
    assert sidebar.alive()[-1][1] == dict.fromkeys(range(WORLD), True), sidebar.alive()


def test_stop_leaves_nothing_on_the_hosts(ipython, hosts, started):
    res, out = run(ipython, "%mpnb stop")
    assert res.success and "exited" not in out, out
    assert wait_for(lambda: not any(processes_on(h) for h in HOSTS), timeout=15), {
        h: processes_on(h) for h in HOSTS}
