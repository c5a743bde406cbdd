"""Engines on other machines, started over SSH by ipyparallel's own SSH engine launcher.

`%mpnb start --ssh hostA:2,hostB:2` (or `mpnb.start(ssh={"hostA": 2, "hostB": 2})`) checks every
host before any engine starts: the spec, that `ssh` logs in without a password, and that the
Python there can import mpnb and ipyparallel. The controller then listens on the one address of
this machine that the hosts are reached through (never on all interfaces), and ipyparallel's
`SSHEngineSetLauncher` starts the engines (all at once: `mpnb.cluster.ssh_launcher`), which receive
the controller's connection info in their environment (no files copied). A real cluster's SSH
settings stay in `~/.ssh/config`; `ssh_args` adds options for this start only.

Kernel side: never imports torch.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mpnb.errors import ClusterError, ConfigError

# Fails fast on a host that does not answer or asks for a password, instead of hanging the start.
_PREFLIGHT_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
_PREFLIGHT_TIMEOUT_S = 30.0
_HOST = re.compile(r"^(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9._-]+$")
_EXAMPLE = "`%mpnb start --ssh node1:2,node2:2` (host:engines, comma-separated)"


def check_options(ssh: object, ssh_args: object, python: object, *, n: object, devices: object,
                  port: object) -> None:
    """Options of a local start and of an SSH start are not mixed."""
    if ssh is None and (ssh_args is not None or python is not None):
        raise ConfigError("--ssh-args and --python are for engines on other hosts: add --ssh HOST:N.")
    if ssh is not None and (n is not None or devices is not None or port is not None):
        raise ConfigError(
            "--ssh gives the engines per host itself (host:N), so -n, --devices and --port do not "
            f"apply. Example: {_EXAMPLE}."
        )


def checked_cluster(
    spec: str | Mapping[str, int], ssh_args: str | Sequence[str] | None, python: str | None,
    controller_args: list[str], log: Any, log_path: str,
) -> tuple[Any, int, str]:
    """Everything checked, then the unstarted cluster, its engine count and the session's source line.

    `python` defaults to this kernel's interpreter path (the same path on a shared filesystem)."""
    hosts, extra, remote_python = parse_hosts(spec), check_args(ssh_args), python or sys.executable
    preflight(hosts, extra, remote_python)
    address = controller_address(hosts, extra)
    built = cluster(hosts, extra, remote_python, address, controller_args, log, log_path)
    source = "start --ssh " + ",".join(f"{h}:{k}" for h, k in hosts.items())
    return built, sum(hosts.values()), source


def parse_hosts(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"[user@]host:N,..."` (or a mapping) as `{"[user@]host": N}` in the order given."""
    if isinstance(spec, Mapping):
        items = [(str(h), n) for h, n in spec.items()]
    else:
        items = []
        for part in (p.strip() for p in str(spec).split(",")):
            host, sep, count = part.rpartition(":")
            if not part or not sep:
                raise ConfigError(f"--ssh needs host:engines, not {part!r}. Example: {_EXAMPLE}.")
            items.append((host, count))
    hosts: dict[str, int] = {}
    for host, count in items:
        if not _HOST.match(host):
            raise ConfigError(f"--ssh: {host!r} is not a host name or user@host. Example: {_EXAMPLE}.")
        try:
            n = int(count) if not isinstance(count, bool) else 0
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            raise ConfigError(f"--ssh: {host} needs a whole number of engines, at least 1, not {count!r}.")
        if host in hosts:
            raise ConfigError(f"--ssh lists {host} twice. Give each host once with its engine count.")
        hosts[host] = n
    if not hosts:
        raise ConfigError(f"--ssh names no host. Example: {_EXAMPLE}.")
    return hosts


def check_args(ssh_args: str | Sequence[str] | None) -> list[str]:
    """Extra ssh options as a list (a string is split as a shell would)."""
    if ssh_args is None:
        return []
    return shlex.split(ssh_args) if isinstance(ssh_args, str) else [str(a) for a in ssh_args]


def preflight(hosts: Mapping[str, int], ssh_args: list[str], python: str) -> None:
    """Every host logs in without a password and its `python` imports mpnb; all checked at once."""
    if shutil.which("ssh") is None:
        raise ClusterError("--ssh needs the `ssh` client here (Debian: apt-get install openssh-client).")
    probe = "import ipyparallel, mpnb"
    with ThreadPoolExecutor(len(hosts)) as pool:
        results = list(pool.map(lambda h: (h, _run_ssh(h, ssh_args, [python, "-c", probe])), hosts))
    problems = [_explain(host, python, rc, err) for host, (rc, err) in results if rc != 0]
    if problems:
        raise ClusterError("No engine was started:\n" + "\n".join(problems))


def _run_ssh(host: str, ssh_args: list[str], command: list[str]) -> tuple[int, str]:
    argv = ["ssh", *_PREFLIGHT_OPTIONS, *ssh_args, host, shlex.join(command)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_PREFLIGHT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 255, f"no answer within {_PREFLIGHT_TIMEOUT_S:g} s"
    return done.returncode, done.stderr.strip()


def _explain(host: str, python: str, rc: int, stderr: str) -> str:
    last = stderr.splitlines()[-1] if stderr else f"exit status {rc}"
    if rc == 255:  # ssh's own failure: the login, not the command
        return (f"  {host}: ssh could not log in ({last}). Check that `ssh {host} true` works without a "
                "password (a key in ~/.ssh, `ssh-copy-id`), or pass the options with ssh_args.")
    if rc == 127:
        return f"  {host}: there is no {python} ({last}). Pass the Python that has mpnb there with --python."
    return (f"  {host}: {python} cannot import mpnb or ipyparallel ({last}). Install mpnb there "
            "(the same version as here), or pass the right interpreter with --python.")


def controller_address(hosts: Mapping[str, int], ssh_args: list[str]) -> str:
    """The one address of this machine that every host is reached through: the controller's.

    Host names go through `ssh -G` first, so an alias in ~/.ssh/config finds its real name."""
    sources = {host: _source_address(_real_host(host, ssh_args)) for host in hosts}
    distinct = sorted(set(sources.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{h} via {a}" for h, a in sources.items())
        raise ClusterError(
            f"The hosts are reached through different addresses of this machine ({listing}), and the "
            "controller listens on one. Start the cluster with `ipcluster start --engines=ssh "
            "--ip=*` outside the notebook and `%mpnb connect` to it."
        )
    return distinct[0]


def _real_host(host: str, ssh_args: list[str]) -> str:
    try:
        done = subprocess.run(["ssh", "-G", *ssh_args, host], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return host.rpartition("@")[2]
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value:
            return value
    return host.rpartition("@")[2]


def _source_address(host: str) -> str:
    """The local address the kernel's packets to `host` leave from (no packet is sent)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 22, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            source = s.getsockname()[0]
    except OSError as exc:
        raise ClusterError(f"--ssh: cannot find a route to {host} ({exc}). Check the host name.") from None
    return "127.0.0.1" if ipaddress.ip_address(source).is_loopback else source


def _stderr_to(program: str, log_path: str) -> list[str]:
    """`program` with its stderr appended to `log_path`: ipyparallel's ssh and scp calls would print
    the remote side's tracebacks (a stop signalling an engine that had already exited) to the kernel."""
    return ["sh", "-c", f'exec {program} "$@" 2>>{shlex.quote(log_path)}', program]


def cluster(hosts: Mapping[str, int], ssh_args: list[str], python: str, controller_ip: str,
            controller_args: list[str], log: Any, log_path: str) -> Any:
    """An unstarted `ipp.Cluster` whose engines ipyparallel's SSH launcher starts on `hosts`."""
    import ipyparallel as ipp
    from traitlets.config import Config

    config = Config()
    config.SSHLauncher.ssh_cmd = _stderr_to("ssh", log_path)
    config.SSHLauncher.scp_cmd = _stderr_to("scp", log_path)
    config.SSHLauncher.ssh_args = ["-o", "BatchMode=yes", *ssh_args]
    config.SSHLauncher.scp_args = ["-o", "BatchMode=yes", *ssh_args]
    config.SSHLauncher.remote_python = python
    config.SSHEngineSetLauncher.engines = dict(hosts)
    config.SSHEngineSetLauncher.engine_cmd = [python, "-m", "mpnb.engine.boot"]
    config.SSHEngineLauncher.to_send = []  # the connection info travels in the engines' environment
    return ipp.Cluster(
        n=sum(hosts.values()),
        engine_launcher_class="mpnb.cluster.ssh_launcher.ParallelSSHEngineSetLauncher",
        controller_ip=controller_ip,
        controller_args=controller_args,
        config=config,
        delay=0,
        log=log,
        shutdown_atexit=False,
    )
