"""release_peers' pid check: connections are shut down only to a pid that is still the process recorded
when the world formed (same start time), never to a dead rank's or a reused pid."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mpnb.cluster.reaper import start_ticks
from mpnb.engine import gloo_unblock

pytestmark = pytest.mark.skipif(not gloo_unblock.SUPPORTED, reason="needs /proc (Linux)")

# a peer: connects to us, then waits for stdin to close
PEER = "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); sys.stdin.read()"


@pytest.fixture
def peer():
    """(peer process, our end of its TCP connection to us)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(server.getsockname()[1])], stdin=subprocess.PIPE
        )
        server.settimeout(10)
        conn, _ = server.accept()
    conn.settimeout(5)
    try:
        yield proc, conn
    finally:
        conn.close()
        proc.stdin.close()
        proc.wait(10)


def test_start_time_names_one_process(peer):
    proc, _ = peer
    started = start_ticks(proc.pid)
    assert isinstance(started, int) and started > 0
    assert start_ticks(proc.pid) == started  # fixed for the life of the process
    assert gloo_unblock.same_processes([(proc.pid, started)]) == [proc.pid]
    assert gloo_unblock.same_processes([(proc.pid, started + 1)]) == []  # a reused pid: another process
    assert gloo_unblock.same_processes([(proc.pid, None)]) == []  # not recorded: never touched
    own = start_ticks("self")
    assert gloo_unblock.same_processes([(os.getpid(), own)]) == []  # never ourselves


def test_a_peer_whose_recorded_start_time_differs_is_skipped(peer):
    proc, conn = peer
    started = start_ticks(proc.pid)
    wrong = gloo_unblock.same_processes([(proc.pid, started - 1)])
    assert gloo_unblock.shut_down_connections_to(wrong) == 0
    conn.sendall(b"ping")  # the connection is untouched: it still carries data both ways
    assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    right = gloo_unblock.same_processes([(proc.pid, started)])
    assert gloo_unblock.shut_down_connections_to(right) == 1
    assert conn.recv(16) == b""  # shut down: our end reads end-of-stream at once


def test_a_dead_peer_is_skipped():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = start_ticks(proc.pid)
    proc.wait(10)
    assert started is not None
    assert start_ticks(proc.pid) is None
    assert gloo_unblock.same_processes([(proc.pid, started)]) == []
