"""The memory sampler thread that runs inside every engine.

An engine executes one cell at a time, so the notebook cannot ask it for memory
numbers while a cell runs. Instead a daemon thread samples the device (10 Hz
while a cell runs, 1 Hz when idle) and pushes each sample over its own ZMQ PUSH
socket to the notebook kernel's PULL socket (`mpnb.monitoring.channel`). Messages
are signed with the cluster's own key in `jupyter_client.Session`'s wire format
(the HMAC scheme ipyparallel's own messages use), so the kernel can drop
anything unsigned, forged or replayed; the format is `mpnb.monitoring.protocol`,
the one kernel-side module the engine imports.

"Busy" is true while the engine executes code (IPython's pre/post_execute
events, which fire for every `view.execute`) or while `set_busy(True)` is in
force (for callers that run work through `apply`). The reported peak restarts
with each execute, so it is the peak of the current (or last) cell.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any

from mpnb.engine import comm_bytes, state
from mpnb.engine.readers import MemoryReader, make_reader
from mpnb.monitoring.protocol import (
    MAX_SAMPLES_PER_MESSAGE,
    MSG_TYPE,
    PARTS,
    Signer,
    estimate_content,
    make_sample,
    samples_content,
)

DEFAULT_BUSY_HZ = 10.0
DEFAULT_IDLE_HZ = 1.0
# Samples taken at 10 Hz travel in batches at most this often (the chart redraws ~4 times a second).
DEFAULT_SEND_INTERVAL = 0.25
# The Trainer's breakdown (a walk over every tensor) is read at most this often; while it reads
# the same numbers the wait doubles, up to the maximum (it changes in the first steps, then rarely).
DEFAULT_BREAKDOWN_INTERVAL = 0.5
MAX_BREAKDOWN_INTERVAL = 4.0
_EARLY_STEPS = 3  # the breakdown is re-read right after each of these first optimizer steps
# Samples waiting in the socket when the kernel is gone; beyond this they are dropped, never block.
_SEND_HWM = 1000

_sampler: Sampler | None = None
# This engine's CURVE key pair (only the public half leaves) and the last (endpoint, server key).
_keypair: tuple[bytes, bytes] | None = None
_curve_server: tuple[str, bytes] | None = None
_busy_flag = False
_executing = False
_lock = threading.Lock()


def is_busy() -> bool:
    return _busy_flag or _executing


def set_busy(busy: bool) -> None:
    """Mark this rank busy/idle by hand (e.g. around work run with `apply`)."""
    global _busy_flag
    _busy_flag = bool(busy)
    wake()


def _on_pre_execute(*_: Any) -> None:
    global _executing
    _executing = True
    reset_peak()  # each cell gets its own peak
    wake()


def _on_post_execute(*_: Any) -> None:
    global _executing
    _executing = False
    wake()


def wake() -> None:
    """Have the sampler look now for a new estimate or announcement instead of at its next tick."""
    sampler = _sampler
    if sampler is not None:
        sampler.wake.set()


def trainer_parts(trainer: Any | None) -> dict[str, int] | None:
    """The Trainer's bytes by category, or None if it cannot say right now."""
    if trainer is None:
        return {key: 0 for key in PARTS}
    try:
        breakdown = trainer.memory_breakdown()
        return {key: int(breakdown.get(key, 0) or 0) for key in PARTS}
    except Exception:  # the training loop may be mutating its state right now
        return None


def build_sample(reader: MemoryReader, rank: int, busy: bool, parts: dict[str, int]) -> dict[str, Any]:
    """One sample in the format of docs/internals.md ("Memory samples")."""
    reading = reader.read()
    return make_sample(
        rank=rank, t=time.time(), busy=busy, device_kind=reading.device_kind, used=reading.used,
        reserved=reading.reserved, peak=reading.peak, capacity=reading.capacity,
        device_used=reading.device_used, oom_count=reading.oom_count, parts=parts,
        comm_sent=comm_bytes.sent_by_this_rank(reading.device_kind),
    )


def _NO_REF() -> None:  # a dead weak reference: calling it gives None
    return None


def announce_estimate(estimate: Any) -> None:
    """Keep `estimate` and send its line at once (`mpnb.prepare` calls this before it applies a strategy).

    `estimate` is what `mpnb.estimate` predicts for the model being prepared, from the whole
    model before ZeRO-3 or FSDP shard it or a pipeline keeps one stage; None clears the line.
    """
    state.set_estimate(estimate)
    wake()


class Sampler(threading.Thread):
    """Samples memory at the busy or idle rate and pushes each sample to the kernel."""

    def __init__(
        self,
        endpoint: str,
        key: bytes,
        signature_scheme: str = "hmac-sha256",
        busy_hz: float = DEFAULT_BUSY_HZ,
        idle_hz: float = DEFAULT_IDLE_HZ,
        reader: MemoryReader | None = None,
        send_interval: float = DEFAULT_SEND_INTERVAL,
        breakdown_interval: float = DEFAULT_BREAKDOWN_INTERVAL,
        curve: tuple[bytes, bytes, bytes] | None = None,
    ) -> None:
        super().__init__(name="mpnb-memory-sampler", daemon=True)
        if busy_hz <= 0 or idle_hz <= 0:
            raise ValueError(f"sampling rates must be > 0 Hz, got busy={busy_hz}, idle={idle_hz}")
        self.endpoint = endpoint
        self.busy_hz = float(busy_hz)
        self.idle_hz = float(idle_hz)
        self.send_interval = float(send_interval)
        self.breakdown_interval = float(breakdown_interval)
        self.paused = False
        self.sent = 0
        self.errors = 0
        self.cpu_seconds = 0.0  # CPU time this thread has used: the monitor's own cost
        self.wake = threading.Event()
        self._stop_event = threading.Event()
        self._key = key
        self._scheme = signature_scheme
        self._curve = curve  # server public key, own public and secret key
        self._reader = reader
        self._reader_device: str | None = None
        self._fixed_reader = reader is not None

    def stop(self, timeout: float = 2.0) -> bool:
        self._stop_event.set()
        self.wake.set()
        self.join(timeout)
        return not self.is_alive()

    def _current_reader(self) -> MemoryReader:
        # The device is bound by bootstrap; rebuild the reader if it changed since.
        if not self._fixed_reader and (self._reader is None or self._reader_device != state.device):
            self._reader = make_reader(state.device)
            self._reader_device = state.device
        assert self._reader is not None
        return self._reader

    def _send(self, socket: Any, signer: Signer, samples: list[dict[str, Any]]) -> None:
        import zmq

        try:
            socket.send(signer.packed(MSG_TYPE, samples_content(samples)), zmq.NOBLOCK)
            self.sent += len(samples)
        except Exception:  # zmq.Again: the kernel is not reading; drop rather than block the engine
            self.errors += 1

    def _send_extra(self, socket: Any, signer: Signer, content: dict[str, Any]) -> None:
        import zmq

        try:
            socket.send(signer.packed(MSG_TYPE, content), zmq.NOBLOCK)
        except Exception:  # no estimate line or checkpoint row is better than no samples
            self.errors += 1

    def run(self) -> None:
        import zmq

        signer = Signer(self._key, self._scheme)
        context = zmq.Context()
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
        if self._curve is not None:  # the kernel's channel admits only the keys it was given
            socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = self._curve
        socket.connect(self.endpoint)
        comm_bytes.leave_uncounted(self.endpoint)  # the monitor's bytes, not the training's
        pending: list[dict[str, Any]] = []
        last_send = 0.0
        last_busy: bool | None = None
        estimated = 0  # the state.estimate_version sent last (0: none announced yet)
        # A weak reference: the user may drop a Trainer to free its memory.
        parts: dict[str, int] = {key: 0 for key in PARTS}
        parts_of = _NO_REF  # the trainer `parts` was read from, when, and the wait till the next read
        parts_at = 0.0
        parts_wait = self.breakdown_interval
        parts_steps: int | None = None  # trainer.steps at that read
        try:
            while not self._stop_event.is_set():
                if self.paused:
                    if self.wake.wait(1.0):
                        self.wake.clear()
                    continue
                busy = is_busy()
                now = time.monotonic()
                if state.estimate_version != estimated:  # {} clears the kernel's line (no estimate)
                    estimated = state.estimate_version
                    line = state.last_estimate.by_rank() if state.last_estimate is not None else {}
                    self._send_extra(socket, signer, estimate_content(line))
                while state.announcements:  # finished checkpoints (mpnb.engine.checkpoint.announce)
                    self._send_extra(socket, signer, state.announcements.popleft())
                trainer = state.active_trainer()
                # Walking every tensor costs ~0.4 ms on a small model, half the sampler's cost at a
                # fixed 0.5 s: refresh it at most every `parts_wait`, which grows while nothing changes,
                # and at once after each of the first steps (when gradients and optimizer state appear).
                new_trainer = parts_of() is not trainer
                steps = getattr(trainer, "steps", None)
                early_step = steps != parts_steps and isinstance(steps, int) and steps <= _EARLY_STEPS
                if new_trainer or early_step or now - parts_at >= parts_wait:
                    fresh = trainer_parts(trainer)
                    if fresh is not None:
                        unchanged = fresh == parts and not new_trainer
                        longer = min(2 * parts_wait, MAX_BREAKDOWN_INTERVAL)
                        parts_wait = longer if unchanged else self.breakdown_interval
                        parts, parts_at, parts_steps = fresh, now, steps
                        parts_of = weakref.ref(trainer) if trainer is not None else _NO_REF
                del trainer
                try:
                    pending.append(build_sample(self._current_reader(), state.rank, busy, parts))
                except Exception:
                    self.errors += 1
                # Batch while busy: each send hands the GIL back and forth several times, which
                # a training loop on a crowded CPU feels; a busy/idle change goes out at once.
                full = len(pending) >= MAX_SAMPLES_PER_MESSAGE  # the kernel refuses more in one
                if pending and (full or busy != last_busy or now - last_send >= self.send_interval):
                    self._send(socket, signer, pending)
                    pending, last_send, last_busy = [], now, busy
                self.cpu_seconds = time.thread_time()
                interval = 1.0 / (self.busy_hz if busy else self.idle_hz)
                if self.wake.wait(interval):
                    self.wake.clear()
            if pending:
                self._send(socket, signer, pending)
        finally:
            socket.close(linger=0)
            context.term()
            close = getattr(self._reader, "close", None)
            if close is not None and not self._fixed_reader:
                close()


def _engine_session() -> tuple[bytes, str]:
    """The key and scheme this engine signs its ipyparallel messages with."""
    from IPython import get_ipython

    ip = get_ipython()
    kernel = getattr(ip, "kernel", None)
    if kernel is None:
        raise RuntimeError("not inside an ipyparallel engine: pass key= explicitly")
    return kernel.session.key, kernel.session.signature_scheme


def curve_publickey() -> bytes:
    """This engine's CURVE public key for the kernel's allow-list (the secret half stays here)."""
    return _own_keypair()[0]


def _own_keypair() -> tuple[bytes, bytes]:
    global _keypair
    import zmq

    _keypair = _keypair or zmq.curve_keypair()
    return _keypair


def _curve_for(endpoint: str, serverkey: bytes | None) -> tuple[bytes, bytes, bytes] | None:
    global _curve_server
    if serverkey:
        _curve_server = (endpoint, serverkey)
    elif _curve_server is not None and _curve_server[0] == endpoint:
        serverkey = _curve_server[1]  # a restart by hand (new rates, another key) keeps the channel's
    return (serverkey, *_own_keypair()) if serverkey else None


def _set_execute_hooks(on: bool) -> None:
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:
        return
    for event, callback in (("pre_execute", _on_pre_execute), ("post_execute", _on_post_execute)):
        with contextlib.suppress(ValueError):
            ip.events.unregister(event, callback)
        if on:
            ip.events.register(event, callback)


def start(
    endpoint: str,
    *,
    key: bytes | None = None,
    signature_scheme: str | None = None,
    busy_hz: float = DEFAULT_BUSY_HZ,
    idle_hz: float = DEFAULT_IDLE_HZ,
    reader: MemoryReader | None = None,
    curve_serverkey: bytes | None = None,
) -> dict[str, Any]:
    """Start (or restart) this engine's sampler, pushing to the kernel at `endpoint`.

    Without `key`, the engine's own ipyparallel session key is used, so the
    secret never travels over the network (under CurveZMQ, the kernel sends one, encrypted).
    `curve_serverkey`: the kernel channel's (else the last given for this endpoint).
    """
    global _sampler
    if key is None:
        key, scheme = _engine_session()
        signature_scheme = signature_scheme or scheme
    curve = _curve_for(endpoint, curve_serverkey)
    with _lock:
        if _sampler is not None:
            _sampler.stop()
        scheme = signature_scheme or "hmac-sha256"
        _sampler = Sampler(endpoint, key, scheme, busy_hz, idle_hz, reader, curve=curve)
        _set_execute_hooks(True)
        _sampler.start()
    return {"rank": state.rank, "endpoint": endpoint, "busy_hz": busy_hz, "idle_hz": idle_hz}


def stop(timeout: float = 2.0) -> bool:
    """Stop the sampler; True once its thread has exited and its socket is closed."""
    global _sampler
    with _lock:
        sampler, _sampler = _sampler, None
        _set_execute_hooks(False)
    return True if sampler is None else sampler.stop(timeout)


def configure(busy_hz: float | None = None, idle_hz: float | None = None) -> None:
    """Change the sampling rates of the running sampler."""
    sampler = _sampler
    if sampler is None:
        return
    for name, value in (("busy_hz", busy_hz), ("idle_hz", idle_hz)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
            setattr(sampler, name, float(value))
    sampler.wake.set()


def pause(paused: bool = True) -> None:
    """Stop sampling without stopping the thread (resume with `pause(False)`)."""
    sampler = _sampler
    if sampler is not None:
        sampler.paused = bool(paused)
        sampler.wake.set()


def reset_peak() -> None:
    """Start a new peak window (the kernel calls this at the start of each cell)."""
    sampler = _sampler
    if sampler is not None and sampler._reader is not None:
        sampler._reader.reset_peak()


def status() -> dict[str, Any]:
    sampler = _sampler
    if sampler is None:
        return {"running": False}
    return {
        "running": sampler.is_alive(),
        "endpoint": sampler.endpoint,
        "busy_hz": sampler.busy_hz,
        "idle_hz": sampler.idle_hz,
        "sent": sampler.sent,
        "errors": sampler.errors,
        "cpu_seconds": sampler.cpu_seconds,
        "busy": is_busy(),
        "paused": sampler.paused,
    }
