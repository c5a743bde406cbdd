"""What listens on a local cluster: every TCP listening socket of the kernel and of all its descendants
(controller, engines, nannies) is on loopback, after start and after each heal; collectives still work.

Before, rank 0's process-group store listened on `::` (every interface, unauthenticated), a new one
per heal. The sockets are read from /proc/<pid>/fd and /proc/net/tcp{,6}, as `ss -tlp` would.
"""

from __future__ import annotations

import os
import socket
import sys

import psutil
import pytest

from mpnb.cluster import lifecycle as cluster_mod
from tests.helpers import own_cluster, run

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

LISTEN = "0A"  # TCP state in /proc/net/tcp
ALL_REDUCE = "\n".join(
    [
        "%%distributed --no-monitor",
        "t = torch.ones(1) * (rank + 1)",
        "dist.all_reduce(t)",
        "print('sum', int(t.item()))",
    ]
)


def address(hex_endpoint: str) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080): /proc writes each 32-bit word of the address little-endian."""
    hex_address, hex_port = hex_endpoint.split(":")
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(hex_port, 16)


def listening_sockets() -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every listening TCP socket of this process and its descendants."""
    by_inode: dict[int, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == LISTEN:
                    by_inode[int(fields[9])] = address(fields[1])
    found = []
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            command = " ".join(proc.cmdline())[:80]
            fds = os.listdir(f"/proc/{proc.pid}/fd")
        except (OSError, psutil.Error):
            continue  # gone meanwhile
        for link in filter(None, (_link(f"/proc/{proc.pid}/fd/{fd}") for fd in fds)):
            if link.startswith("socket:[") and int(link[8:-1]) in by_inode:
                found.append((proc.pid, command, *by_inode[int(link[8:-1])]))
    return found


def _link(path: str) -> str | None:
    """Where an fd points, or None once it closed: engines open and close files all the time (imports,
    the monitor's fd scan), and one closed fd must not hide the process's sockets."""
    try:
        return os.readlink(path)
    except OSError:
        return None


def assert_only_loopback(sess) -> list[tuple[int, str, str, int]]:
    found = listening_sockets()
    engines = {r.pid for r in sess.ranks}
    assert engines <= {pid for pid, *_ in found}, found  # the engines were seen (their ipyparallel sockets)
    exposed = [s for s in found if s[2] in ("0.0.0.0", "::")]
    assert not exposed, f"listening on every interface: {exposed}"
    assert all(s[2] in ("127.0.0.1", "::1") for s in found), found  # not even the host's outside address
    return found


def assert_all_reduce(ip) -> None:
    res, out = run(ip, ALL_REDUCE)
    assert res.success and "sum 3" in out, out


@pytest.fixture(scope="module")
def sess():
    with own_cluster(timeout=20) as s:
        yield s


@pytest.fixture(scope="module")
def ip(ipython, sess):
    return ipython


def test_every_listening_socket_is_on_loopback_after_start(ip, sess):
    assert_only_loopback(sess)
    assert_all_reduce(ip)
    assert_only_loopback(sess)


def test_and_after_each_heal_with_ddp(ip, sess):
    for _ in range(2):
        cluster_mod.heal(verbose=False)
        assert_only_loopback(sess)
        assert_all_reduce(ip)
    res, out = run(
        ip,
        "%%distributed --no-monitor\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "m = DDP(torch.nn.Linear(2, 1, bias=False))\nwith torch.no_grad(): m.module.weight.fill_(1.0)\n"
        "m(torch.ones(1, 2) * (rank + 1)).sum().backward()\nprint('grad', m.module.weight.grad.tolist())\n",
    )
    assert res.success and "grad [[1.5, 1.5]]" in out, out  # gradients averaged over the two ranks
    assert_only_loopback(sess)


def test_the_engines_gloo_interface_is_loopback(sess):
    names = sess.view().apply_sync(lambda: os.environ.get("GLOO_SOCKET_IFNAME"))
    loopback = {
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs)
    }
    assert set(names) <= loopback and names[0], names
