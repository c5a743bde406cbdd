"""Kernel end of the memory side channel: a ZMQ PULL socket fed by every engine.

Each engine's sampler (`mpnb.engine.monitor`) pushes signed messages here
(format: `mpnb.monitoring.protocol`). A receiver thread checks each signature
with the cluster's key (the same `jupyter_client.Session` HMAC that ipyparallel
uses; unsigned, badly signed, replayed and oversized messages are dropped and
counted, and so are signed samples with bad fields) and hands the samples to a
`MemoryStore` in batches; nothing that arrives ends the thread. The socket binds
to the cluster's interface (127.0.0.1 for a local cluster), never to all
interfaces unless asked to, and refuses frames over `protocol.MAX_MESSAGE_BYTES`
before reading them.

`attach` makes the socket a CURVE server with a key pair of its own and a ZAP
allow-list of the engines' public keys (each engine makes its pair; only the
public half travels). A process that is not one of the session's engines cannot
complete the handshake, so it cannot make the kernel hold any message at all
(zmq queues a multipart message whole before anyone can read it, whatever the
frame size limit). Samples are still signed: CURVE keeps strangers out and
encrypts, the HMAC says which key the sender holds. Under ipyparallel's own
CurveZMQ (`IPP_ENABLE_CURVE=1`, its session key then empty) the channel signs
with a random key, sent to the engines inside ipyparallel's encrypted messages.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket as pysocket
import threading
from typing import TYPE_CHECKING, Any

from mpnb.errors import ClusterError
from mpnb.execution import ipp_private
from mpnb.monitoring import protocol

if TYPE_CHECKING:
    from mpnb.monitoring.store import MemoryStore

log = logging.getLogger(__name__)

_MAX_BATCH = 500
# Complete messages queued per engine connection before zmq pushes back on the sender (engines
# send ~4 a second); keeps a flood's backlog in the sender's memory, not the kernel's.
_RCVHWM = 64
INTERFACE_ENV = "MPNB_MONITOR_INTERFACE"


class _AllowList:
    """ZAP credentials provider: the CURVE public keys (Z85) allowed to connect."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class MonitorChannel:
    """Binds a PULL socket and feeds verified samples to a store from a background thread.

    With `curve_secretkey` the socket is a CURVE server that admits only the public
    keys given to `allow`.
    """

    def __init__(
        self,
        store: MemoryStore,
        key: bytes,
        signature_scheme: str = "hmac-sha256",
        interface: str = "127.0.0.1",
        port: int = 0,
        curve_secretkey: bytes | None = None,
    ) -> None:
        if not key:
            raise ClusterError(
                "The memory monitor needs the cluster's message key to authenticate samples, and "
                "this cluster has none. Start the cluster with a key (ipyparallel's default)."
            )
        self.store = store
        self.interface = interface
        self.received = 0  # samples accepted
        self.dropped = 0  # messages rejected (bad signature, malformed, replayed, failed handling)
        self.invalid = 0  # samples in signed messages dropped for a field of the wrong type or range
        self._key = key
        self._curve_secretkey = curve_secretkey
        self.curve_publickey: bytes | None = None  # what engines need to connect over CURVE
        self._allowed = _AllowList()
        self._authenticator: Any = None
        if curve_secretkey:
            import zmq

            self.curve_publickey = zmq.curve_public(curve_secretkey)
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

    def allow(self, public_keys: list[bytes]) -> None:
        """Let clients with these CURVE public keys (Z85, as `zmq.curve_keypair` makes them) connect."""
        self._allowed.keys.update(public_keys)

    @property
    def signing_key(self) -> bytes:
        return self._key

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> str:
        """Bind and start receiving; returns the endpoint engines connect to."""
        import zmq

        if self.running:
            return self.endpoint
        self._context = zmq.Context()
        if self._curve_secretkey:  # the allow-list must answer before the first handshake
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(self._context, log=log.getChild("zap"))
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", self._allowed)
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        # Set before bind: a larger frame disconnects its sender before zmq allocates it.
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        if self._curve_secretkey:
            sock.curve_server = True
            sock.curve_secretkey = self._curve_secretkey
        try:
            if self._port:
                sock.bind(f"tcp://{self.interface}:{self._port}")
                port = self._port
            else:
                port = sock.bind_to_random_port(f"tcp://{self.interface}")
        except zmq.ZMQError as e:
            sock.close()
            self._close_context()
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

        verifier = protocol.Verifier(self._key, self._scheme)
        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                try:
                    self._receive_some(zmq, poller, sock, verifier)
                except Exception:  # whatever arrives, the monitor keeps running
                    self.dropped += 1
                    log.debug("mpnb monitor: a batch failed", exc_info=True)
                    self._stop_event.wait(0.05)  # no busy loop if the failure repeats
        finally:
            sock.close(linger=0)
            self._close_context()

    def _close_context(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._context.term()

    def _receive_some(self, zmq: Any, poller: Any, sock: Any, verifier: protocol.Verifier) -> None:
        if not poller.poll(100):
            return
        batch: list[dict[str, Any]] = []
        while len(batch) < _MAX_BATCH:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            batch.extend(self._verify(verifier, frames))
        if batch:
            self.received += len(batch)
            self.store.add(batch)

    def _verify(self, verifier: protocol.Verifier, frames: list[bytes]) -> list[dict[str, Any]]:
        """The valid samples in one message, or [] (and a count in `dropped`) if it is not authentic.

        A message may also carry the estimate for the rank's new Trainer, which goes
        to `store.set_estimate`, or a finished checkpoint (`store.add_checkpoint`).
        Samples with bad fields are counted in `invalid`.
        """
        try:
            decoded = protocol.decode(verifier, frames)
            if decoded.estimate is not None:
                self.store.set_estimate(decoded.estimate)
            if decoded.checkpoint is not None:
                self.store.add_checkpoint(decoded.checkpoint)
        except Exception:
            self.dropped += 1
            return []
        self.invalid += decoded.invalid
        return decoded.samples


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
        channel = _new_channel(session)
        channel.start()
        session.monitor_channel = channel
    rates = {
        "busy_hz": busy_hz if busy_hz is not None else monitor.DEFAULT_BUSY_HZ,
        "idle_hz": idle_hz if idle_hz is not None else monitor.DEFAULT_IDLE_HZ,
    }
    extra: dict[str, Any] = {"curve_serverkey": channel.curve_publickey}
    if channel.signing_key != session.client.session.key:  # ipyparallel's CurveZMQ: no key of its own
        extra.update(key=channel.signing_key, signature_scheme=channel._scheme)
    try:
        channel.allow(session.view().apply_sync(monitor.curve_publickey))
        session.view().apply_sync(monitor.start, channel.endpoint, **rates, **extra)
    except Exception:
        channel.stop()
        session.monitor_channel = None
        raise
    return channel


def _new_channel(session: Any) -> MonitorChannel:
    """A CURVE server with a fresh key pair, checking signatures with the cluster's key.

    ipyparallel with `IPP_ENABLE_CURVE=1` encrypts its own sockets and drops its HMAC key;
    then the channel signs with a random key, which reaches the engines inside
    ipyparallel's CURVE-encrypted messages and never touches disk. A cluster with
    neither has no secret at all, and the channel refuses it.
    """
    import zmq

    client = session.client
    key = client.session.key
    if not key and getattr(client, "curve_serverkey", None):
        key = secrets.token_bytes(32)
    _, secret = zmq.curve_keypair()
    return MonitorChannel(
        session.memory, key, client.session.signature_scheme, bind_interface(client), curve_secretkey=secret
    )


def detach(session: Any, timeout: float = 5.0) -> None:
    """Stop every rank's sampler (best effort: engines may be dead) and close the kernel end."""
    from mpnb.engine import monitor

    with contextlib.suppress(Exception):
        session.view().apply_async(monitor.stop).wait(timeout)
    channel: MonitorChannel | None = getattr(session, "monitor_channel", None)
    if channel is not None:
        channel.stop()
        session.monitor_channel = None
