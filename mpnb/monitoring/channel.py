"""Kernel end of the memory side channel: a ZMQ PULL socket fed by every engine.

Each engine's sampler (`mpnb.engine.monitor`) pushes signed messages here
(format: `mpnb.monitoring.protocol`). A receiver thread checks each signature
with the cluster's key (the same `jupyter_client.Session` HMAC that ipyparallel
uses; unsigned, badly signed and replayed messages are dropped and counted) and
hands the samples to a `MemoryStore` in batches. The socket binds to the
cluster's interface (127.0.0.1 for a local cluster), never to all interfaces
unless asked to.
"""

from __future__ import annotations

import contextlib
import os
import socket as pysocket
import threading
from typing import TYPE_CHECKING, Any

from mpnb.errors import ClusterError
from mpnb.execution import ipp_private
from mpnb.monitoring import protocol

if TYPE_CHECKING:
    from mpnb.monitoring.store import MemoryStore

_MAX_BATCH = 500
INTERFACE_ENV = "MPNB_MONITOR_INTERFACE"


class MonitorChannel:
    """Binds a PULL socket and feeds verified samples to a store from a background thread."""

    def __init__(
        self,
        store: MemoryStore,
        key: bytes,
        signature_scheme: str = "hmac-sha256",
        interface: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if not key:
            raise ClusterError(
                "The memory monitor needs the cluster's message key to authenticate samples, and "
                "this cluster has none. Start the cluster with a key (ipyparallel's default)."
            )
        self.store = store
        self.interface = interface
        self.received = 0  # samples accepted
        self.dropped = 0  # messages rejected (bad signature, malformed, replayed)
        self._key = key
        self._scheme = signature_scheme
        self._port = port
        self._endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._socket: Any = None
        self._context: Any = None

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("MonitorChannel.start() has not been called")
        return self._endpoint

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> str:
        """Bind and start receiving; returns the endpoint engines connect to."""
        import zmq

        if self.running:
            return self.endpoint
        self._context = zmq.Context()
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self._port:
                sock.bind(f"tcp://{self.interface}:{self._port}")
                port = self._port
            else:
                port = sock.bind_to_random_port(f"tcp://{self.interface}")
        except zmq.ZMQError as e:
            sock.close()
            self._context.term()
            raise ClusterError(
                f"The memory monitor could not listen on {self.interface}: {e}. Set the environment "
                f"variable {INTERFACE_ENV} to an address of this machine that the engines can reach."
            ) from e
        self._socket = sock
        self._endpoint = f"tcp://{self.interface}:{port}"
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._receive_loop, name="mpnb-monitor-channel", daemon=True)
        self._thread.start()
        return self._endpoint

    def stop(self, timeout: float = 2.0) -> None:
        """Stop receiving and close the socket (the thread owns it and closes it on exit)."""
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def _receive_loop(self) -> None:
        import zmq
        from jupyter_client.session import Session

        session = Session(key=self._key, signature_scheme=self._scheme, username="mpnb-kernel")
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                if not poller.poll(100):
                    continue
                batch: list[dict[str, Any]] = []
                while len(batch) < _MAX_BATCH:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    batch.extend(self._verify(session, frames))
                if batch:
                    self.received += len(batch)
                    self.store.add(batch)
        finally:
            sock.close(linger=0)
            self._context.term()

    def _verify(self, session: Any, frames: list[bytes]) -> list[dict[str, Any]]:
        """The samples in one message, or [] (and a count in `dropped`) if it is not authentic.

        A message may also carry the estimate for the rank's new Trainer, which goes
        to `store.set_estimate`.
        """
        try:
            samples, estimate = protocol.decode(session, frames)
        except Exception:
            self.dropped += 1
            return []
        if estimate is not None:
            self.store.set_estimate(estimate)
        return samples


def bind_interface(client: Any) -> str:
    """The address the kernel listens on: where the engines can reach this machine.

    A local cluster's controller listens on 127.0.0.1, and so do we. Otherwise we
    take this machine's address on the route to the controller (the engines
    already reach the controller's network), never 0.0.0.0.
    `MPNB_MONITOR_INTERFACE` overrides the choice.
    """
    override = os.environ.get(INTERFACE_ENV)
    if override:
        return override
    config = ipp_private.connection_config(client)
    url = str(config.get("registration") or config.get("interface") or "tcp://127.0.0.1")
    host = url.split("://", 1)[-1].rsplit(":", 1)[0] if url.count(":") > 1 else url.split("://", 1)[-1]
    if host in ("*", "0.0.0.0", ""):
        host = str(config.get("location") or pysocket.gethostname())
    try:
        host = pysocket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"
    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    try:
        with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


# ---------------------------------------------------------------------------- session wiring


def attach(session: Any, busy_hz: float | None = None, idle_hz: float | None = None) -> MonitorChannel:
    """Listen for this session's samples and start the sampler on every rank.

    Called by `mpnb.cluster` after start, connect and restart (restarted engines
    are new processes, so their samplers start again; the kernel end is reused).
    The channel is kept as `session.monitor_channel`.
    """
    from mpnb.engine import monitor  # the function is sent by reference; importing it here is torch-free

    channel: MonitorChannel | None = getattr(session, "monitor_channel", None)
    if channel is None or not channel.running:
        client = session.client
        channel = MonitorChannel(
            session.memory,
            key=client.session.key,
            signature_scheme=client.session.signature_scheme,
            interface=bind_interface(client),
        )
        channel.start()
        session.monitor_channel = channel
    rates = {
        "busy_hz": busy_hz if busy_hz is not None else monitor.DEFAULT_BUSY_HZ,
        "idle_hz": idle_hz if idle_hz is not None else monitor.DEFAULT_IDLE_HZ,
    }
    try:
        session.view().apply_sync(monitor.start, channel.endpoint, **rates)
    except Exception:
        channel.stop()
        session.monitor_channel = None
        raise
    return channel


def detach(session: Any, timeout: float = 5.0) -> None:
    """Stop every rank's sampler (best effort: engines may be dead) and close the kernel end."""
    from mpnb.engine import monitor

    with contextlib.suppress(Exception):
        session.view().apply_async(monitor.stop).wait(timeout)
    channel: MonitorChannel | None = getattr(session, "monitor_channel", None)
    if channel is not None:
        channel.stop()
        session.monitor_channel = None
