"""Per-rank memory on the kernel side: the sample store, the live chart widget, the report.

Samples arrive from the engines' sampler threads through `mpnb.monitor_channel`
into a `MemoryStore` (one per session, `Session.memory`). Charts subscribe to
the store and forward samples to their browser view in batches; the view (in
the labextension) draws them. When a cell of a second or more ends, its chart is replaced by a PNG
rendered here with matplotlib so saved notebooks and nbconvert still show it.
No torch here: this runs in the notebook kernel.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import io
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ipywidgets import DOMWidget
from traitlets import Dict, Float, Int, List, Unicode

log = logging.getLogger(__name__)

CATEGORIES = ("parameters", "gradients", "optimizer", "other")
HISTORY_SECONDS = 600.0
# 10 minutes at 10 Hz, with room for bursts
DEFAULT_MAX_SAMPLES = 7200
# A chart sends at most this many messages a second to its view.
CHART_SENDS_PER_SECOND = 10.0
# Cells shorter than this leave a one-line summary, not an image: a few points are not worth
# the ~0.2 s a matplotlib render adds to every quick cell.
MIN_IMAGE_SECONDS = 1.0
# How long a cell that gets an image waits for each rank's busy->idle sample (sent at once).
FINAL_SAMPLE_WAIT = 0.2

Sample = dict[str, Any]
Subscriber = Callable[[list[Sample]], None]


# ---------------------------------------------------------------------------- store


class MemoryStore:
    """A bounded history of samples per rank, with subscribers fed from the receiver thread."""

    def __init__(self, max_samples_per_rank: int = DEFAULT_MAX_SAMPLES) -> None:
        self.max_samples_per_rank = max_samples_per_rank
        # rank -> total bytes predicted by mpnb.estimate, drawn as a dashed line; None if unknown
        self.estimate: dict[int, int] | None = None
        self._history: dict[int, deque[Sample]] = {}
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    def add(self, samples: Iterable[Sample]) -> None:
        batch = list(samples)
        if not batch:
            return
        with self._lock:
            for sample in batch:
                rank = int(sample["rank"])
                history = self._history.get(rank)
                if history is None:
                    history = self._history[rank] = deque(maxlen=self.max_samples_per_rank)
                history.append(sample)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(batch)
            except Exception:  # one broken chart must not starve the others
                log.exception("memory subscriber %r failed", callback)

    def set_estimate(self, per_rank: dict[int, int] | None) -> None:
        """Set the dashed line: total bytes per rank, as `mpnb.estimate(...).by_rank()` gives.

        Engines send it for each new Trainer; set it by hand for a model they cannot
        estimate (a pipeline stage). Open charts pick it up with their next batch.
        """
        self.estimate = dict(per_rank) if per_rank else None

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(batch)` for every new batch; returns the function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._history)

    def samples(self, rank: int | None = None, since: float | None = None) -> list[Sample]:
        """Samples in time order, for one rank or all, optionally only those at or after `since`."""
        with self._lock:
            histories = [self._history.get(rank, ())] if rank is not None else list(self._history.values())
            out = [s for h in histories for s in h if since is None or s["t"] >= since]
        out.sort(key=lambda s: s["t"])
        return out

    def latest(self) -> dict[int, Sample]:
        with self._lock:
            return {rank: h[-1] for rank, h in self._history.items() if h}

    def peaks(self, since: float | None = None) -> dict[int, dict[str, int]]:
        """Per rank, the largest value seen for each category (each on its own, not summed)."""
        out: dict[int, dict[str, int]] = {}
        for sample in self.samples(since=since):
            row = out.setdefault(int(sample["rank"]), {"samples": 0})
            row["samples"] += 1
            for key in (*CATEGORIES, "used", "peak", "reserved", "device_used", "capacity", "oom_count"):
                value = sample.get(key)
                if value is not None:
                    row[key] = max(row.get(key, 0), int(value))
        return out

    def clear(self) -> None:
        with self._lock:
            self._history.clear()


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
            estimate = _estimate_trait(store.estimate)
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


def _estimate_trait(estimate: dict[int, int] | None) -> dict[str, int]:
    return {str(rank): int(value) for rank, value in (estimate or {}).items()}


def _capacity(store: MemoryStore) -> int:
    return max((int(s.get("capacity") or 0) for s in store.latest().values()), default=0)


# ---------------------------------------------------------------------------- static image


def _gib_or_mib(n: float) -> tuple[float, str]:
    return (n / 2**30, "GiB") if n >= 2**30 else (n / 2**20, "MiB")


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value, unit = _gib_or_mib(float(n))
    return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}"


def render_png(
    samples: list[Sample], estimate: dict[int, int] | None = None, title: str = "memory per rank"
) -> bytes:
    """A stacked-area chart per rank (categories, estimate dashed, peak marked) as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_rank: dict[int, list[Sample]] = {}
    for sample in samples:
        by_rank.setdefault(int(sample["rank"]), []).append(sample)
    ranks = sorted(by_rank) or [0]
    cols = min(len(ranks), 4)
    rows = (len(ranks) + cols - 1) // cols
    fig = Figure(figsize=(3.4 * cols, 2.4 * rows), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    t0 = min((s["t"] for s in samples), default=0.0)
    top = max((max(s["used"], s.get("peak", 0)) for s in samples), default=1)
    if estimate:
        top = max(top, *estimate.values())
    _, unit = _gib_or_mib(top)
    scale = 2**30 if unit == "GiB" else 2**20
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c7c7c7")
    for i, rank in enumerate(ranks):
        ax = axes[i // cols][i % cols]
        data = sorted(by_rank.get(rank, []), key=lambda s: s["t"])
        ax.set_title(f"rank {rank}", fontsize=9)
        if not data:
            continue
        t = [s["t"] - t0 for s in data]
        stacks = [[s.get(c, 0) / scale for s in data] for c in CATEGORIES]
        ax.stackplot(t, *stacks, labels=CATEGORIES, colors=colors, alpha=0.9)
        peak = max(data, key=lambda s: s["used"])
        ax.plot([peak["t"] - t0], [peak["used"] / scale], "v", color="#c44e52", markersize=6)
        ax.annotate(
            f"peak {format_bytes(peak['used'])}",
            (peak["t"] - t0, peak["used"] / scale),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
        if estimate and rank in estimate:
            ax.axhline(estimate[rank] / scale, color="black", linestyle="--", linewidth=1, label="estimate")
        capacity = data[-1].get("capacity") or 0
        # Draw the device limit only where it is in view; a CPU's RAM would flatten everything else.
        if capacity and capacity <= 1.5 * top:
            ax.axhline(capacity / scale, color="#c44e52", linewidth=1.2, label="capacity")
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylim(0, top * 1.18 / scale)  # headroom for the peak label
    for j in range(len(ranks), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    axes[0][0].set_ylabel(unit, fontsize=8)
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


_preloaded = threading.Event()


def _preload_matplotlib() -> None:
    """Import matplotlib's Agg pieces once, in the background, so the first image does not pay for it."""
    if _preloaded.is_set():
        return
    _preloaded.set()

    def load() -> None:
        with contextlib.suppress(ImportError):
            importlib.import_module("matplotlib.backends.backend_agg")
            importlib.import_module("matplotlib.figure")

    threading.Thread(target=load, name="mpnb-matplotlib-preload", daemon=True).start()


# ---------------------------------------------------------------------------- per-cell chart


class CellChart:
    """The chart under one `%%distributed` cell: live while it runs, a PNG once it ends.

    A cell shorter than `MIN_IMAGE_SECONDS` leaves only the one-line peak summary.
    """

    def __init__(self, store: MemoryStore, ranks: list[int], display_output: bool = True) -> None:
        from IPython.display import display

        self.store = store
        self.ranks = list(ranks)
        self.started = time.time()
        self.png: bytes | None = None
        self.widget = MemoryChart(
            ranks=self.ranks, estimate=_estimate_trait(store.estimate), capacity=_capacity(store)
        )
        self.widget.follow(store, since=self.started)
        _preload_matplotlib()
        self._handle = (
            display(self.widget._repr_mimebundle_(), raw=True, display_id=True) if display_output else None
        )
        self._closed = False

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
        self.widget.stop_following()
        samples = [s for s in self.store.samples(since=self.started) if s["rank"] in self.ranks]
        summary = _text_summary(self.store.peaks(since=self.started))
        bundle: dict[str, Any] = {"text/plain": summary}
        if samples and wants_image:
            try:
                self.png = render_png(samples, self.store.estimate, title="memory per rank during this cell")
                bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
            except ImportError:  # matplotlib missing: the text summary still replaces the live chart
                log.warning("mpnb: matplotlib is not installed, so no static memory chart is kept")
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
        self.widget.close()

    def __enter__(self) -> CellChart:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text_summary(peaks: dict[int, dict[str, int]]) -> str:
    if not peaks:
        return "mpnb memory: no samples"
    parts = [f"rank {rank}: peak {format_bytes(row.get('used'))}" for rank, row in sorted(peaks.items())]
    return "mpnb memory · " + ", ".join(parts)


def cell_chart(session: Any, display_output: bool = True) -> CellChart:
    """What `%%distributed` shows under a cell; call `.close()` when the cell ends."""
    return CellChart(session.memory, [r.rank for r in session.ranks], display_output=display_output)


# ---------------------------------------------------------------------------- public API


def _current_store(session: Any | None) -> tuple[Any, MemoryStore]:
    if session is None:
        from mpnb.cluster.session import session as current_session

        session = current_session()
    return session, session.memory


def memory_plot(session: Any | None = None, history_seconds: float = HISTORY_SECONDS) -> MemoryChart:
    """A live chart of every rank's memory (all history kept); display it by leaving it last in a cell."""
    session, store = _current_store(session)
    ranks = [r.rank for r in session.ranks] or store.ranks()
    chart = MemoryChart(
        ranks=ranks,
        estimate=_estimate_trait(store.estimate),
        capacity=_capacity(store),
        history_seconds=history_seconds,
    )
    return chart.follow(store, since=time.time() - history_seconds)


class MemoryReport:
    """Per-rank peak bytes by category; shows as a table, `.data` for your own plots."""

    COLUMNS = ("parameters", "gradients", "optimizer", "other", "used", "peak", "capacity", "estimate")

    def __init__(self, peaks: dict[int, dict[str, int]], estimate: dict[int, int] | None) -> None:
        self.rows: list[dict[str, Any]] = []
        for rank, row in sorted(peaks.items()):
            entry: dict[str, Any] = {"rank": rank}
            for column in self.COLUMNS[:-1]:
                entry[column] = row.get(column, 0)
            entry["estimate"] = (estimate or {}).get(rank)
            if row.get("device_used") is not None and "device_used" in row:
                entry["device_used"] = row["device_used"]
            self.rows.append(entry)

    def to_dict(self) -> dict[int, dict[str, Any]]:
        return {row["rank"]: {k: v for k, v in row.items() if k != "rank"} for row in self.rows}

    @property
    def data(self) -> Any:
        """A pandas DataFrame indexed by rank if pandas is installed, else `to_dict()`."""
        try:
            import pandas as pd
        except ImportError:
            return self.to_dict()
        return pd.DataFrame(self.rows).set_index("rank") if self.rows else pd.DataFrame()

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>mpnb memory report: no samples yet.</p>"
        columns = [c for c in (*self.COLUMNS, "device_used") if any(c in row for row in self.rows)]
        head = "".join(f"<th>{c}</th>" for c in ("rank", *columns))
        body = "".join(
            "<tr>"
            + f"<td>{row['rank']}</td>"
            + "".join(f"<td>{format_bytes(row.get(c))}</td>" for c in columns)
            + "</tr>"
            for row in self.rows
        )
        return (
            "<table class='mpnb-memory-report'><caption>peak memory per rank</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )

    def __repr__(self) -> str:
        lines = ["rank " + " ".join(f"{c:>11}" for c in self.COLUMNS)]
        for row in self.rows:
            lines.append(
                f"{row['rank']:>4} " + " ".join(f"{format_bytes(row.get(c)):>11}" for c in self.COLUMNS)
            )
        return "\n".join(lines)


def memory_report(session: Any | None = None, since: float | None = None) -> MemoryReport:
    """Per rank, the peak of each category (and of total use) over the kept history or since `since`."""
    _, store = _current_store(session)
    return MemoryReport(store.peaks(since=since), store.estimate)
