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
from mpnb.engine.gloo_unblock import borrowed, socket_fds

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is the u64 at byte 120 (since Linux 4.1)
_TCP_INFO_LEN = 232
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_OFFSET = 120
# New connections (a process group formed in a cell) are looked for at most this often; bytes_acked
# counts from a connection's start, so one found late loses nothing.
RESCAN_S = 2.0


def _tcp_peer(fd: int) -> tuple[int, int] | None:
    """(family, peer port) of a connected TCP socket on `fd`, else None (UDP, Unix, listening, closed)."""
    try:
        with borrowed(fd) as sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            return sock.family, sock.getpeername()[1]  # getpeername raises for a listener
    except OSError:
        return None


def _bytes_acked(fd: int) -> int | None:
    try:
        with borrowed(fd) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_OFFSET + _BYTES_ACKED.size:
        return None
    return max(0, _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0] - 1)  # the SYN's ack counts one


class CommCounter:
    """Bytes sent over the TCP connections opened since it was made; `sent()` never goes down."""

    def __init__(self) -> None:
        self._older = set(socket_fds("self"))  # ipyparallel's, the kernel's: not ours to count
        self._tracked: dict[int, tuple[int, int]] = {}  # inode -> (fd, bytes acked last read)
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
            for inode, (fd, last) in list(self._tracked.items()):
                acked = _bytes_acked(fd) if _inode_of(fd) == inode else None
                if acked is None:  # closed (or the fd now names another file)
                    self._retired += last
                    del self._tracked[inode]
                    continue
                self._tracked[inode] = (fd, acked)
                live += acked
            return self._retired + live

    def _rescan(self) -> None:
        for inode, fd in socket_fds("self").items():
            if inode in self._older or inode in self._tracked:
                continue
            peer = _tcp_peer(fd)
            if peer is None:
                continue  # a listener may still accept, so its inode is not written off
            if peer[1] in self.exclude_ports:
                self._older.add(inode)
                continue
            self._tracked[inode] = (fd, 0)


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
