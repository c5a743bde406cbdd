"""The engine's count of bytes sent (`mpnb.engine.comm_bytes`) on real loopback TCP connections.

The counter reads Linux's per-connection `tcpi_bytes_acked`; these tests open real
connections, send known byte counts and check the count is exact, that connections
older than the counter or to an excluded port are not counted, and that a closed
connection's bytes stay counted.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mpnb.engine import comm_bytes
from mpnb.engine.comm_bytes import CommCounter
from mpnb.monitoring.chart import _text_summary
from mpnb.monitoring.chart_image import sent_rates
from mpnb.monitoring.store import MemoryStore


@pytest.fixture(autouse=True)
def rescan_every_read(monkeypatch):
    monkeypatch.setattr(comm_bytes, "RESCAN_S", 0.0)


@contextmanager
def connection() -> Iterator[tuple[socket.socket, int]]:
    """A connected loopback TCP socket whose peer reads everything it gets; and the peer's port."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    peer, _ = server.accept()

    def drain() -> None:
        while peer.recv(1 << 16):
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield client, port
    finally:
        client.close()
        reader.join(5)
        peer.close()
        server.close()


def sent_settles(counter: CommCounter, at_least: int, timeout: float = 5.0) -> int:
    """The count once the peer acknowledged `at_least` bytes (acks trail `sendall`)."""
    deadline = time.monotonic() + timeout
    while counter.sent() < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    return counter.sent()


def test_counts_exactly_the_bytes_sent_on_connections_opened_after_it():
    with connection() as (older, _):
        counter = CommCounter()
        older.sendall(b"x" * 100_000)  # opened before the counter: ipyparallel's, not the training's
        with connection() as (newer, _):
            newer.sendall(b"y" * 3_000_000)
            assert sent_settles(counter, 3_000_000) == 3_000_000
            newer.sendall(b"z" * 1234)
            assert sent_settles(counter, 3_001_234) == 3_001_234


def test_an_excluded_port_is_not_counted_and_a_closed_connection_stays_counted():
    counter = CommCounter()
    with connection() as (monitor_channel, port):
        counter.exclude_ports.add(port)
        monitor_channel.sendall(b"m" * 50_000)
        with connection() as (gloo, _):
            gloo.sendall(b"g" * 200_000)
            assert sent_settles(counter, 200_000) == 200_000
    assert counter.sent() == 200_000  # both closed: the count never goes down


def test_a_listening_socket_is_not_counted_until_it_is_a_connection():
    counter = CommCounter()
    with socket.create_server(("127.0.0.1", 0)):
        assert counter.sent() == 0 and not counter._tracked


def test_rates_and_totals_per_rank_from_the_samples():
    store = MemoryStore()
    sent = [0, 1000, 3000, 3000, 500]  # the last: a replaced engine's counter starts again
    store.add([{"rank": 0, "t": 10.0 + i, "used": 1, "comm_sent": b} for i, b in enumerate(sent[:4])])
    store.add([{"rank": 1, "t": 10.0 + i, "used": 1, "comm_sent": None} for i in range(3)])
    assert sent_rates(store.samples(rank=0)) == ([11.0, 12.0, 13.0], [1000.0, 2000.0, 0.0])
    assert sent_rates([{"t": 0.0, "comm_sent": 3000}, {"t": 1.0, "comm_sent": 500}]) == ([], [])
    assert store.sent() == {0: 3000}
    assert store.sent(since=11.5) == {0: 0}
    peaks = store.peaks()
    summary = "mpnb memory · rank 0: peak 1 B, sent 2.9 KiB; rank 1: peak 1 B"
    assert _text_summary(peaks, store.sent()) == summary
    assert _text_summary(peaks, {}) == "mpnb memory · rank 0: peak 1 B, rank 1: peak 1 B"
