"""The live memory chart widget, the chart under each `%%distributed` cell, and its PNG.

Charts subscribe to the session's `MemoryStore` and forward samples to their
browser view (in the labextension, which draws them) in batches. When a cell of a
second or more ends, its chart is replaced by a PNG drawn with matplotlib
so saved notebooks and nbconvert still show it (`mpnb.monitoring.chart_image`).
No torch here: this runs in the notebook kernel.
"""

from __future__ import annotations

import base64
import importlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ipywidgets import DOMWidget
from traitlets import Dict, Float, Int, List, Unicode

from mpnb.monitoring.chart_image import render_png
from mpnb.monitoring.protocol import Sample, estimate_json
from mpnb.monitoring.store import MemoryStore
from mpnb.units import format_bytes

log = logging.getLogger(__name__)

HISTORY_SECONDS = 600.0
# A chart sends at most this many messages a second to its view.
CHART_SENDS_PER_SECOND = 10.0
# Cells shorter than this leave a one-line summary, not an image: a few points are not worth
# the ~0.2 s a matplotlib render adds to every quick cell.
MIN_IMAGE_SECONDS = 1.0
LIVE_AFTER_S = 0.5  # a cell shorter than this opens no live chart
# How long a cell that gets an image waits for each rank's busy->idle sample (sent at once).
FINAL_SAMPLE_WAIT = 0.2


# ---------------------------------------------------------------------------- widget


class _Batcher:
    """Collects samples from the receiver thread and sends them at most `rate` times a second."""

    def __init__(self, send: Callable[[list[Sample]], None], rate: float = CHART_SENDS_PER_SECOND) -> None:
        self._send = send
        self._interval = 1.0 / rate
        self._pending: list[Sample] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="mpnb-chart-batcher", daemon=True)
        self._thread.start()

    def push(self, samples: list[Sample]) -> None:
        with self._cond:
            self._pending.extend(samples)
            self._cond.notify()

    def close(self) -> None:
        """Send what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2.0)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                batch, self._pending = self._pending, []
                closed = self._closed
            if batch:
                try:
                    self._send(batch)
                except Exception:
                    log.exception("sending memory samples to the chart failed")
            if closed:
                return
            with self._cond:  # pace the sends, but wake at once for close()
                self._cond.wait_for(lambda: self._closed, self._interval)


class MemoryChart(DOMWidget):
    """Live per-rank memory chart; its view lives in the labextension (docs/internals.md)."""

    _model_name = Unicode("MemoryChartModel").tag(sync=True)
    _view_name = Unicode("MemoryChartView").tag(sync=True)
    _model_module = Unicode("mpnb").tag(sync=True)
    _view_module = Unicode("mpnb").tag(sync=True)
    _model_module_version = Unicode("^0.1.0").tag(sync=True)
    _view_module_version = Unicode("^0.1.0").tag(sync=True)

    ranks = List(Int()).tag(sync=True)
    estimate = Dict().tag(sync=True)  # str(rank) -> bytes
    capacity = Int(0).tag(sync=True)  # bytes, 0 if unknown
    history_seconds = Float(HISTORY_SECONDS).tag(sync=True)
    # The time axis counts seconds from here (unix seconds: the cell's start); 0 = the first sample.
    t0 = Float(0.0).tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._store: MemoryStore | None = None
        self._since: float | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._batcher: _Batcher | None = None
        self.on_msg(self._handle_frontend_msg)

    def follow(self, store: MemoryStore, since: float | None = None) -> MemoryChart:
        """Send the store's history from `since` now, then every new batch as it arrives."""
        self.stop_following()
        self._store, self._since = store, since
        self._batcher = _Batcher(self._send_samples)
        history = store.samples(since=since)
        if history:
            self._batcher.push(history)
        self._unsubscribe = store.subscribe(self._on_batch)
        return self

    def stop_following(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._batcher is not None:
            self._batcher.close()
            self._batcher = None

    def close(self) -> None:
        self.stop_following()
        super().close()

    def _on_batch(self, batch: list[Sample]) -> None:
        store = self._store
        if store is not None:
            estimate = estimate_json(store.estimate)
            if estimate != self.estimate:
                self.estimate = estimate
        ranks = set(self.ranks)
        wanted = [s for s in batch if not ranks or s["rank"] in ranks]
        batcher = self._batcher
        if wanted and batcher is not None:
            batcher.push(wanted)

    def _send_samples(self, samples: list[Sample]) -> None:
        if self.comm is not None:
            self.send({"type": "samples", "samples": samples})

    def _handle_frontend_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        # A view that (re)appears after the first messages asks for the history again.
        if isinstance(content, dict) and content.get("type") == "history" and self._store is not None:
            self.send({"type": "reset"})
            history = self._store.samples(since=self._since)
            if history:
                self._send_samples(history)


_preloaded = threading.Event()


def _preload_matplotlib() -> None:
    """Import matplotlib's Agg pieces once, in the background, so the first image does not pay for it."""
    if _preloaded.is_set():
        return
    _preloaded.set()

    def load() -> None:
        importlib.import_module("matplotlib.backends.backend_agg")
        importlib.import_module("matplotlib.figure")

    threading.Thread(target=load, name="mpnb-matplotlib-preload", daemon=True).start()


# ---------------------------------------------------------------------------- per-cell chart


class CellChart:
    """The chart under one `%%distributed` cell: live while it runs, a PNG once it ends.

    Its place under the cell is taken at once (an empty output), but the live widget opens only
    once the cell has run `LIVE_AFTER_S` (`tick`, from the cell's event loop): most cells are
    quicker, and a widget per cell doubled the fixed cost of an empty cell. A cell shorter than
    `MIN_IMAGE_SECONDS` leaves only the one-line peak summary.
    """

    def __init__(self, store: MemoryStore, ranks: list[int], display_output: bool = True) -> None:
        from IPython.display import display

        self.store = store
        self.ranks = list(ranks)
        self.started = time.time()
        self.png: bytes | None = None
        self.widget: MemoryChart | None = None
        _preload_matplotlib()
        self._handle = display({"text/plain": ""}, raw=True, display_id=True) if display_output else None
        self._closed = False

    def tick(self, now: float | None = None) -> None:
        """Open the live chart in its place once the cell has run LIVE_AFTER_S (`now`: time.time())."""
        if self.widget is not None or self._closed:
            return
        if (time.time() if now is None else now) - self.started < LIVE_AFTER_S:
            return
        self.widget = MemoryChart(
            ranks=self.ranks,
            estimate=estimate_json(self.store.estimate),
            capacity=self.store.capacity(),
            t0=self.started,
        )
        self.widget.follow(self.store, since=self.started)  # the cell's samples so far, then live
        if self._handle is not None:
            self._handle.update(self.widget._repr_mimebundle_(), raw=True)

    def _wait_for_final_samples(self, ended: float, timeout: float = FINAL_SAMPLE_WAIT) -> None:
        # Each engine samples as soon as its cell ends; wait briefly so the image shows the end.
        deadline = time.time() + timeout
        while time.time() < deadline:
            latest = self.store.latest()
            if all(r in latest and latest[r]["t"] >= ended for r in self.ranks):
                return
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the live feed and leave a static image in the cell's output."""
        if self._closed:
            return
        self._closed = True
        ended = time.time()
        wants_image = ended - self.started >= MIN_IMAGE_SECONDS
        if wants_image:
            self._wait_for_final_samples(ended)
        if self.widget is not None:
            self.widget.stop_following()
        samples = [s for s in self.store.samples(since=self.started) if s["rank"] in self.ranks]
        summary = _text_summary(self.store.peaks(since=self.started), self.store.sent(since=self.started))
        bundle: dict[str, Any] = {"text/plain": summary}
        if samples and wants_image:
            self.png = render_png(
                samples, self.store.estimate, title="memory per rank during this cell", t0=self.started
            )
            bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
        if self.widget is not None:
            self.widget.close()

    def __enter__(self) -> CellChart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text_summary(peaks: dict[int, dict[str, int]], sent: dict[int, int]) -> str:
    """ "mpnb memory · rank 0: peak 412 MiB, sent 4.0 MiB; rank 1: ..." ("sent" where any rank sent)."""
    if not peaks:
        return "mpnb memory: no samples"
    show_sent = any(sent.values())
    parts = [
        f"rank {rank}: peak {format_bytes(row.get('used'))}"
        + (f", sent {format_bytes(sent[rank])}" if show_sent and rank in sent else "")
        for rank, row in sorted(peaks.items())
    ]
    return "mpnb memory · " + ("; " if show_sent else ", ").join(parts)


def cell_chart(session: Any, display_output: bool = True) -> CellChart:
    """What `%%distributed` shows under a cell; call `.close()` when the cell ends."""
    return CellChart(session.memory, [r.rank for r in session.ranks], display_output=display_output)


# ---------------------------------------------------------------------------- public API


def memory_plot(session: Any | None = None, history_seconds: float = HISTORY_SECONDS) -> MemoryChart:
    """A live chart of every rank's memory (all history kept); display it by leaving it last in a cell."""
    if session is None:
        from mpnb.cluster.session import session as current_session

        session = current_session()
    store = session.memory
    ranks = [r.rank for r in session.ranks] or store.ranks()
    chart = MemoryChart(
        ranks=ranks,
        estimate=estimate_json(store.estimate),
        capacity=store.capacity(),
        history_seconds=history_seconds,
    )
    return chart.follow(store, since=time.time() - history_seconds)
