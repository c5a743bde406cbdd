"""`MemoryStore`: the kernel's bounded history of memory samples per rank (`Session.memory`).

The side channel's receiver thread adds batches; charts, the report and the
dashboard read the history and subscribe to new batches. It also keeps the
checkpoints the engines saved in this session (`checkpoints()`), which the
sidebar and `%mpnb checkpoint list` show. Standard library only:
`mpnb.cluster.session` imports this module, so it must not import the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from mpnb.monitoring.protocol import CATEGORIES, Sample

log = logging.getLogger(__name__)

# 10 minutes at 10 Hz, with room for bursts
DEFAULT_MAX_SAMPLES = 7200
# Checkpoints remembered per session (one per path); a loop that saves every K steps to new paths
# forever keeps the newest.
MAX_CHECKPOINTS = 200
# Per rank, the fields whose largest value `peaks` reports.
PEAK_KEYS = (*CATEGORIES, "used", "peak", "reserved", "device_used", "capacity", "oom_count")

Subscriber = Callable[[list[Sample]], None]


class MemoryStore:
    """A bounded history of samples per rank, with subscribers fed from the receiver thread."""

    def __init__(self, max_samples_per_rank: int = DEFAULT_MAX_SAMPLES) -> None:
        self.max_samples_per_rank = max_samples_per_rank
        # rank -> total bytes predicted by mpnb.estimate, drawn as a dashed line; None if unknown
        self.estimate: dict[int, int] | None = None
        # Grows with each checkpoint added, so the dashboard sends a new list exactly once.
        self.checkpoints_version = 0
        self._checkpoints: dict[str, dict[str, Any]] = {}  # path -> record, oldest first
        self._history: dict[int, deque[Sample]] = {}
        self._heard: dict[int, float] = {}  # rank -> when its last sample arrived (kernel's monotonic clock)
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    def add(self, samples: Iterable[Sample]) -> None:
        batch = list(samples)
        if not batch:
            return
        arrived = time.monotonic()
        with self._lock:
            for sample in batch:
                rank = int(sample["rank"])
                self._heard[rank] = arrived
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

    def add_checkpoint(self, record: dict[str, Any]) -> None:
        """Remember a finished save (`protocol.valid_checkpoint`'s fields); the same path again
        replaces the older record and moves to the end."""
        with self._lock:
            self._checkpoints.pop(record["path"], None)
            self._checkpoints[record["path"]] = dict(record)
            while len(self._checkpoints) > MAX_CHECKPOINTS:
                del self._checkpoints[next(iter(self._checkpoints))]
            self.checkpoints_version += 1

    def checkpoints(self) -> list[dict[str, Any]]:
        """The checkpoints saved in this session, one per path, newest last: path, step, strategy,
        label (e.g. "ZeRO-2"), world_size, bytes (all ranks' files), seconds (the save), t (when done)."""
        with self._lock:
            return [dict(r) for r in self._checkpoints.values()]

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

    def last_heard(self) -> dict[int, float]:
        """When each rank's last sample arrived, on this kernel's `time.monotonic` clock."""
        with self._lock:
            return dict(self._heard)

    def latest(self) -> dict[int, Sample]:
        with self._lock:
            return {rank: h[-1] for rank, h in self._history.items() if h}

    def capacity(self) -> int:
        """The largest device capacity the ranks last reported, 0 if unknown."""
        return max((int(s.get("capacity") or 0) for s in self.latest().values()), default=0)

    def peaks(self, since: float | None = None) -> dict[int, dict[str, int]]:
        """Per rank, the largest value seen for each category (each on its own, not summed)."""
        out: dict[int, dict[str, int]] = {}
        for sample in self.samples(since=since):
            row = out.setdefault(int(sample["rank"]), {"samples": 0})
            row["samples"] += 1
            for key in PEAK_KEYS:
                value = sample.get(key)
                if value is not None:
                    row[key] = max(row.get(key, 0), int(value))
        return out

    def sent(self, since: float | None = None) -> dict[int, int]:
        """Per rank that counts them, the bytes sent over torch.distributed between its first and last
        sample since `since` (none for a rank whose counter went down: its engine was replaced)."""
        counts: dict[int, list[int]] = {}
        for sample in self.samples(since=since):
            if sample.get("comm_sent") is not None:
                counts.setdefault(int(sample["rank"]), []).append(int(sample["comm_sent"]))
        return {rank: c[-1] - c[0] for rank, c in counts.items() if c[-1] >= c[0]}

    def clear(self) -> None:
        with self._lock:
            self._history.clear()
