"""Bytes this rank sent over torch.distributed, read from Linux's per-connection TCP counters.

Gloo moves every collective and every send/recv over TCP connections between the
ranks, and Linux counts, per connection, the payload bytes the peer acknowledged
(`tcp_info.tcpi_bytes_acked`). Summed over the connections torch.distributed
opened, that is what this rank put on the wire, whoever issued it (DDP's C++
reducer, FSDP, DTensor, DeepSpeed, pipeline send/recv), with no hook in the
training loop: the monitor reads it with every memory sample. The rendezvous
store's connection counts too (a few hundred bytes per group formed).

Which connections: TCP sockets opened after the counter was made (bootstrap makes
it before the first process group, so ipyparallel's own ZMQ connections are
older), less those to `exclude_ports` (the monitor's own channel). NCCL moves its
bytes over NVLink or InfiniBand, which no socket sees; the monitor sends no
number on CUDA ranks.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from mpnb.engine import state
from mpnb.engine.gloo_unblock import socket_fds

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is the u64 at byte 120 (since Linux 4.1)
_TCP_INFO_LEN = 232
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_OFFSET = 120
# New connections (a process group formed in a cell) are looked for at most this often; bytes_acked
# counts from a connection's start, so one found late loses nothing.
RESCAN_S = 2.0


def _borrow(fd: int, family: int = socket.AF_INET) -> socket.socket:
    """A socket object on `fd` that must be `detach`ed, never closed: the fd belongs to gloo."""
    return socket.socket(family, socket.SOCK_STREAM, 0, fd)


def _tcp_peer_family(fd: int) -> int | None:
    """The family of a connected TCP socket on `fd`, else None (UDP, Unix, listening, closed)."""
    sock = _borrow(fd)
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
            return None
        family = sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
        if family not in (socket.AF_INET, socket.AF_INET6):
            return None
        sock.getpeername()  # raises for a listener
        return family
    except OSError:
        return None
    finally:
        sock.detach()


def _peer_port(fd: int, family: int) -> int | None:
    sock = _borrow(fd, family)
    try:
        return sock.getpeername()[1]
    except OSError:
        return None
    finally:
        sock.detach()


def _bytes_acked(fd: int, family: int) -> int | None:
    sock = _borrow(fd, family)
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    finally:
        sock.detach()
    if len(info) < _BYTES_ACKED_OFFSET + _BYTES_ACKED.size:
        return None
    return max(0, _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0] - 1)  # the SYN's ack counts one


class CommCounter:
    """Bytes sent over the TCP connections opened since it was made; `sent()` never goes down."""

    def __init__(self) -> None:
        self._older = set(socket_fds("self"))  # ipyparallel's, the kernel's: not ours to count
        self._tracked: dict[int, tuple[int, int, int]] = {}  # inode -> (fd, family, bytes acked last read)
        self._retired = 0  # what connections that closed had sent when last read
        self._scanned = float("-inf")
        self._lock = threading.Lock()
        self.exclude_ports: set[int] = set()

    def sent(self) -> int:
        with self._lock:
            now = time.monotonic()
            if now - self._scanned >= RESCAN_S:
                self._rescan()
                self._scanned = now
            live = 0
            for inode, (fd, family, last) in list(self._tracked.items()):
                acked = _bytes_acked(fd, family) if _inode_of(fd) == inode else None
                if acked is None:  # closed (or the fd now names another file)
                    self._retired += last
                    del self._tracked[inode]
                    continue
                self._tracked[inode] = (fd, family, acked)
                live += acked
            return self._retired + live

    def _rescan(self) -> None:
        for inode, fd in socket_fds("self").items():
            if inode in self._older or inode in self._tracked:
                continue
            family = _tcp_peer_family(fd)
            if family is None:
                continue  # a listener may still accept, so its inode is not written off
            if _peer_port(fd, family) in self.exclude_ports:
                self._older.add(inode)
                continue
            self._tracked[inode] = (fd, family, 0)


def _inode_of(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def sent_by_this_rank(device_kind: str) -> int | None:
    """Bytes torch.distributed has sent from this engine, or None where sockets do not carry them."""
    counter = state.comm_counter
    if counter is None or device_kind != "cpu":  # NCCL's bytes go over NVLink/InfiniBand
        return None
    return counter.sent()


def leave_uncounted(endpoint: str) -> None:
    """Count nothing sent to `endpoint` ("tcp://127.0.0.1:5555": the monitor's channel)."""
    if state.comm_counter is not None:
        state.comm_counter.exclude_ports.add(int(endpoint.rsplit(":", 1)[1]))
