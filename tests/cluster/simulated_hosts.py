"""Two hosts simulated for real on this machine: network namespaces joined by a Linux bridge.

Each host is a namespace with its own address on a private /24 that exists only between the
namespaces made here, its own loopback, and its own host name (`unshare --uts`). The controller
(and the test process, the "kernel") stays in the root namespace on the bridge's address; each
host runs its engines as a launcher would start them there. `/etc/netns/NS/` gives each host a
resolver with no name server (lookups fail at once instead of waiting on the machine's resolver)
and a hosts file in which the host names resolve, or do not. With `sshd=True` each host runs its own
sshd on its address only, with a host key and a client key made for the test (`Hosts.ssh_args`), so
that ipyparallel's SSH launcher starts engines there as on real machines.

Everything made here is removed on exit, also when a test fails, and leftovers of a killed run are
removed before a new start. Needs root and iproute2; `skip_reason()` says why not where they lack.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

NET = "10.77.0"  # private, only between the namespaces made here
BRIDGE = "mpnbbr0"
BRIDGE_ADDR = f"{NET}.1"
HOSTS = {"mpnb-host-a": 11, "mpnb-host-b": 12}  # host name -> last octet
CLUSTER_ID = "mpnbhosts"
SSHD = "/usr/sbin/sshd"


@dataclass
class Hosts:
    profile_dir: Path
    cluster_id: str
    addresses: dict[str, str]  # host name -> its address
    ssh_args: list[str]  # with sshd: the options that log in to every host as root


def skip_reason(sshd: bool = False) -> str | None:
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces); CI runs as root"
    tools = ("ip", "unshare") + (("ssh", "ssh-keygen", SSHD) if sshd else ())
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (Debian: iproute2, util-linux, openssh-server)"
    return None


def namespace(host: str) -> str:
    return f"ns-{host}"


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def pids_in(host: str) -> list[int]:
    """The processes running in `host`'s namespace (none once it is gone)."""
    listing = subprocess.run(["ip", "netns", "pids", namespace(host)], capture_output=True, text=True)
    return [int(pid) for pid in listing.stdout.split()]


def remove_all() -> None:
    """What a start made (or a killed run left): engines, namespaces, links, resolver files."""
    for host in HOSTS:
        ns = namespace(host)
        for pid in pids_in(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    for i in range(len(HOSTS)):  # the kernel frees a deleted namespace's links later, so remove them now
        _ip("link", "del", f"mpnbv{i}b", check=False)
    _ip("link", "del", BRIDGE, check=False)
    with contextlib.suppress(OSError):
        os.rmdir("/etc/netns")  # only where empty: nobody else's files there


def _network(names_resolve: bool) -> None:
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for i, (host, octet) in enumerate(HOSTS.items()):
        ns, inside, outside = namespace(host), f"mpnbv{i}a", f"mpnbv{i}b"
        _ip("netns", "add", ns)
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", BRIDGE)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{NET}.{octet}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("")
        names = [f"{NET}.{o} {h}" for h, o in HOSTS.items()] if names_resolve else []
        (etc / "hosts").write_text("\n".join(["127.0.0.1 localhost", *names]) + "\n")


def set_link(host: str, up: bool) -> None:
    """The host's only network link up or down: down, the host drops off the network as a whole."""
    index = list(HOSTS).index(host)
    _ip("-n", namespace(host), "link", "set", f"mpnbv{index}a", "up" if up else "down")


def wait(ready: Callable[[], object], proc: subprocess.Popen, what: str, seconds: float) -> None:
    """Poll `ready` until it is true; raise "`what` within `seconds` s" if `proc` exits or time runs out."""
    deadline = time.monotonic() + seconds
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} within {seconds:g} s: it exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {seconds:g} s")
        time.sleep(0.1)


def on_host(host: str, script: str, **popen) -> subprocess.Popen:
    """`sh -c script` on the simulated host: in its network namespace, under its own host name, in a
    session of its own (for `kill_all`); output discarded."""
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace(host), "unshare", "--uts", "sh", "-c",
         f"hostname {host}; {script}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **popen,
    )


def _keys(workdir: Path) -> Path:
    keys = workdir / "ssh"
    keys.mkdir(mode=0o700, exist_ok=True)
    for name in ("client", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    return keys


def _start_sshd(host: str, address: str, keys: Path) -> subprocess.Popen:
    """An sshd listening on `address` only, in the host's namespace under its own host name."""
    config = keys / f"sshd-{host}.conf"
    config.write_text("\n".join([
        f"ListenAddress {address}", f"HostKey {keys / 'host'}",
        f"AuthorizedKeysFile {keys / 'authorized_keys'}", f"PidFile {keys / f'sshd-{host}.pid'}",
        "Subsystem sftp internal-sftp", "UsePAM no", "StrictModes no", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "LogLevel ERROR",
    ]) + "\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    return on_host(host, f"exec {SSHD} -D -e -f {config}")


def _listening(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def ssh_args(keys: Path) -> list[str]:
    return ["-i", str(keys / "client"), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]


@contextlib.contextmanager
def simulated_hosts(workdir: Path, *, engines_per_host: int = 2, names_resolve: bool = True,
                    sshd: bool = False) -> Iterator[Hosts]:
    """`engines_per_host` engines on each simulated host (and a controller on the bridge for them,
    when there are any); `sshd`: an SSH server on each host too."""
    remove_all()
    profile = workdir / "profile_hosts"
    profile.mkdir(parents=True, exist_ok=True)
    addresses = {h: f"{NET}.{o}" for h, o in HOSTS.items()}
    procs: list[subprocess.Popen] = []
    try:
        _network(names_resolve)
        keys = _keys(workdir) if sshd else None
        if keys is not None:
            for host, address in addresses.items():
                procs.append(_start_sshd(host, address, keys))
                listening = functools.partial(_listening, address, 22)
                wait(listening, procs[-1], f"nothing listened on {address}:22", 30)
        if not engines_per_host:
            yield Hosts(profile, CLUSTER_ID, addresses, ssh_args(keys) if keys else [])
            return
        controller = subprocess.Popen(
            [sys.executable, "-m", "ipyparallel.controller", f"--profile-dir={profile}",
             f"--cluster-id={CLUSTER_ID}", f"--ip={BRIDGE_ADDR}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        procs.append(controller)
        engine_file = profile / "security" / f"ipcontroller-{CLUSTER_ID}-engine.json"
        wait(engine_file.exists, controller, f"the controller wrote no {engine_file.name}", 60)
        engine = (f"{sys.executable} -m ipyparallel.engine --file={engine_file} --profile-dir={profile} "
                  f"--cluster-id={CLUSTER_ID}")
        for host in HOSTS:
            script = " ".join([f"{engine} &"] * engines_per_host) + " wait"
            procs.append(on_host(host, script, env=dict(os.environ, OMP_NUM_THREADS="1")))
        yield Hosts(profile, CLUSTER_ID, addresses, ssh_args(keys) if keys else [])
    finally:
        kill_all(procs)
        remove_all()


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process's group (each was started in a session of its own) and reap it."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
