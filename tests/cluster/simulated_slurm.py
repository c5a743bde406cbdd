"""A Slurm cluster on the simulated hosts (`simulated_hosts.py`): slurmctld on the first host, a
slurmd on each, and one munged for their credentials; configuration, state and logs in the test's
directory, slurmd's spool (it holds sockets, whose paths must stay under 108 bytes) in a short one.

`sbatch`, `scancel` and `squeue` find it through `SLURM_CONF` in the environment `simulated_slurm`
yields, as on a real cluster's login node. `ip netns exec` gives each host its own mount namespace
with a fresh /sys, where slurmd finds no /sys/fs/cgroup and refuses to start, so each host's shell
mounts a tmpfs there with the cgroup v1 freezer and a named `systemd` hierarchy (which slurmd's
cgroup plugin looks for) before starting slurmd. Everything runs in the hosts' namespaces (removed
with them) but munged, which is stopped on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .simulated_hosts import HOSTS, Hosts, kill_all, on_host, wait

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue")
CGROUPS = " && ".join([
    "mount -t tmpfs cgroup /sys/fs/cgroup", "mkdir /sys/fs/cgroup/freezer /sys/fs/cgroup/systemd",
    "mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer",
    "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd",
])


def skip_reason() -> str | None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"a simulated Slurm cluster needs {', '.join(missing)} "
                "(Debian: slurmctld slurmd slurm-client munge)")
    return None


def _config(home: Path, spool: Path, hosts: Hosts, socket: Path) -> Path:
    head = next(iter(HOSTS))
    nodes = [f"NodeName={host} NodeAddr={ip} CPUs=2 State=UNKNOWN" for host, ip in hosts.addresses.items()]
    conf = home / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=mpnbsim", f"SlurmctldHost={head}({hosts.addresses[head]})",
        "AuthType=auth/munge", f"AuthInfo=socket={socket}", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={home / 'state'}", f"SlurmdSpoolDir={spool / '%n'}",
        f"SlurmctldPidFile={home / 'slurmctld.pid'}", f"SlurmdPidFile={home / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={home / 'slurmctld.log'}", f"SlurmdLogFile={home / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        *nodes, "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    return conf


def _start_munged(home: Path) -> tuple[subprocess.Popen, Path]:
    key, socket = home / "munge.key", home / "munge.sock"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munged = subprocess.Popen(
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket}",
         f"--pid-file={home / 'munged.pid'}", f"--log-file={home / 'munged.log'}",
         f"--seed-file={home / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    wait(socket.exists, munged, "munged made no socket (its log: slurm/munged.log)", 20)
    return munged, socket


def _idle_nodes(env: dict[str, str]) -> int:
    listing = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
    return listing.stdout.split().count("idle")


def _jobs(env: dict[str, str]) -> list[str]:
    listing = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
    return listing.stdout.split()


@contextlib.contextmanager
def simulated_slurm(workdir: Path, hosts: Hosts) -> Iterator[dict[str, str]]:
    """Slurm on `hosts`; yields the environment in which Slurm's commands reach it."""
    home = workdir / "slurm"
    (home / "state").mkdir(parents=True, exist_ok=True)
    spool = Path(tempfile.mkdtemp(prefix="mpnb-slurm-"))  # slurmd's sockets there: paths under 108 bytes
    for host in HOSTS:
        (spool / host).mkdir()
    procs: list[subprocess.Popen] = []
    try:
        munged, socket = _start_munged(home)
        procs.append(munged)
        conf = _config(home, spool, hosts, socket)
        env = dict(os.environ, SLURM_CONF=str(conf))
        head = next(iter(HOSTS))
        procs.append(on_host(head, f"exec slurmctld -D -i -f {conf}"))
        for host in HOSTS:
            procs.append(on_host(host, f"{CGROUPS} && exec slurmd -D -f {conf} -N {host}"))
        wait(lambda: _idle_nodes(env) == len(HOSTS), procs[1], "the nodes were not idle (logs: slurm/)", 60)
        yield env
        with contextlib.suppress(RuntimeError):  # jobs that were cancelled end (their tasks killed) first
            wait(lambda: not _jobs(env), procs[1], "Slurm's jobs did not end", 30)
    finally:
        kill_all(procs)
        shutil.rmtree(spool, ignore_errors=True)
