"""Unblocking a gloo peer that waits on this process, by shutting down TCP connections (Linux only).

`destroy_process_group()` is not enough while a DDP model (or any other holder)
keeps a reference to the group: gloo then keeps its connections open, and
neither `abort()` nor `shutdown()` closes them on gloo (measured on torch 2.13:
the peer waited until this process exited). So `shut_down_connections_to`
shuts down, at the socket level, this process's TCP connections to the other
ranks on this host, found through /proc; the waiting peer's recv then fails
with "Connection closed by peer". Peers on other hosts cannot be matched that
way, so the connections a process group opened while it formed are recorded
(`connections_opened_by`) and `shut_down` ends them whatever host the peer is on.

Other platforms have no /proc to match connections with: there the call does
nothing (`UNSUPPORTED_REASON` says why) and blocked peers return at the
process-group timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

from mpnb.cluster.reaper import start_ticks

T = TypeVar("T")

log = logging.getLogger("mpnb")

SUPPORTED = sys.platform.startswith("linux")
UNSUPPORTED_REASON = (
    ""
    if SUPPORTED
    else f"{sys.platform} has no /proc to find the peers' TCP connections; "
    "peers blocked on this rank return at the process-group timeout"
)


def shut_down_connections_to(pids: list[int]) -> int:
    """Shut down (not close: the fds stay gloo's) this process's TCP connections to `pids`.

    A connection is ours to `pid` when its remote end is the local end of one of
    `pid`'s sockets. Returns how many were shut down (0 where unsupported).
    """
    if not pids:
        return 0
    if not SUPPORTED:
        log.debug("mpnb: not shutting down connections to %s: %s", pids, UNSUPPORTED_REASON)
        return 0
    table = _tcp_connections()
    peer_ends = {table[inode][0] for pid in pids for inode in socket_fds(pid) if inode in table}
    own = socket_fds("self")
    return shut_down({inode for inode in own if inode in table and table[inode][1] in peer_ends})


def connections_opened_by(form: Callable[[], T]) -> tuple[T, set[int]]:
    """`form()`'s result and the socket inodes of the TCP connections this process opened during it
    (gloo connects every pair of ranks while its group forms); an empty set where unsupported."""
    if not SUPPORTED:
        return form(), set()
    before = set(socket_fds("self"))
    result = form()
    table = _tcp_connections()
    return result, {inode for inode in set(socket_fds("self")) - before
                    if inode in table and table[inode][1][1] != 0}  # connected, not listening


def shut_down(inodes: set[int]) -> int:
    """Shut down this process's sockets among `inodes` (recorded by `connections_opened_by`)."""
    count = 0
    for inode, fd in socket_fds("self").items():
        if inode in inodes:
            with contextlib.suppress(OSError), borrowed(fd) as sock:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count


@contextlib.contextmanager
def borrowed(fd: int) -> Iterator[socket.socket]:
    """A socket object on this process's `fd` that leaves it open: the fd stays its owner's (gloo's)."""
    sock = socket.socket(fileno=fd)  # raises OSError if `fd` is not a socket (any more)
    try:
        yield sock
    finally:
        sock.detach()


# A peer host that stops answering (link down, power off) fails the connections to it after about
# this long: TCP keepalive probes an idle connection (a rank waiting to receive) from 2 s of silence,
# 1 s apart, 3 times; unacknowledged data (a rank sending) gives up after the same time. A live
# host's kernel answers both however busy its processes are; without this, gloo waits out the
# process group's timeout.
PEER_HOST_GONE_S = 5
_KEEPALIVE = ((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
              (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", 4), 2),
              (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", 5), 1),
              (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", 6), 3),
              (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18), PEER_HOST_GONE_S * 1000))


def fail_fast(inodes: set[int]) -> int:
    """Make this process's connections among `inodes` that lead to another host fail within
    PEER_HOST_GONE_S once that host stops answering; returns how many (0 where unsupported)."""
    if not SUPPORTED or not inodes:
        return 0
    table = _tcp_connections()
    count = 0
    for inode, fd in socket_fds("self").items():
        if inode not in inodes or inode not in table or _is_loopback(table[inode][1][0]):
            continue
        try:
            with borrowed(fd) as sock:
                for level, option, value in _KEEPALIVE:
                    sock.setsockopt(level, option, value)
            count += 1
        except OSError:
            log.debug("mpnb: keepalive not set on fd %s", fd, exc_info=True)
    return count


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def same_processes(peers: list[tuple[int, int | None]]) -> list[int]:
    """The pids of `peers` ((pid, start time when the world formed)) that are still those processes.

    A peer that died, whose start time was not recorded, or whose pid now belongs to another
    process (a different start time) is left out: its connections are never touched."""
    own = os.getpid()
    return [
        pid for pid, started in peers if started is not None and pid != own and start_ticks(pid) == started
    ]


def socket_fds(pid: int | str) -> dict[int, int]:
    """Socket inode -> fd number for the process `pid` ("self" for this one)."""
    found = {}
    directory = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(directory):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{directory}/{fd}")
                if link.startswith("socket:["):
                    found[int(link[8:-1])] = int(fd)
    return found


def _tcp_connections() -> dict[int, tuple[tuple[str, int], tuple[str, int]]]:
    """Socket inode -> ((local ip, port), (remote ip, port)) from /proc/net/tcp and tcp6."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                table[int(fields[9])] = (_endpoint(fields[1]), _endpoint(fields[2]))
    return table


def _endpoint(hex_endpoint: str) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080); IPv6 words are little-endian; v4-mapped v6 -> v4."""
    address, port = hex_endpoint.split(":")
    raw = bytes.fromhex(address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)
