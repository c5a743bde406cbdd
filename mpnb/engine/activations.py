"""Activation bytes autograd keeps for backward: the memory chart's "activations (tracked)".

On CPU there is no allocator to ask what activations hold, and on GPU torch's counters
do not say which allocations are activations. `LiveActivationMeter` counts what autograd
saves for backward (saved-tensor hooks): a storage adds its bytes when first saved and
gives them back when autograd lets go of the last tensor saved on it, so it follows
backwards as they free activations (notebook 04 compares pipeline schedules with it).
Parameters, and views of them, are not counted: they are held anyway. What autograd does
not save (a forward's temporaries, communication buffers) is not counted either, so this
is a lower bound.

`ActivationTracker` runs a meter around `Trainer.step`. The hooks cost one Python call per
saved tensor, ~10% of a tiny model's CPU step, so only the first steps and then one in
`EVERY` are tracked: with fixed batch shapes the peak repeats. torch is imported only when
a meter runs, so `mpnb.teaching` stays importable without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# (storage pointer, storage bytes): one entry per storage however many tensors share it
StorageKey = tuple[int, int]
FIRST_STEPS = 3  # tracked every time (shapes and the optimizer's state settle)
EVERY = 16  # then one step in this many


def saved_storage(t: Any) -> StorageKey | None:
    """The storage a saved tensor keeps alive; None for parameters (and their views) and empty storages."""
    import torch

    try:
        base = t._base if t._base is not None else t
        if isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
            return None
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # DTensor: its shard
        size = storage.nbytes()
        return (storage.data_ptr(), size) if size else None
    except Exception:  # a tensor subclass or a freed storage without a data pointer: not counted
        return None


class _Saved:
    """One tensor autograd keeps for backward; tells the meter when autograd lets go of it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: LiveActivationMeter, tensor: Any, key: StorageKey | None) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class LiveActivationMeter:
    """Bytes autograd holds for backward *right now*, and their peak (`peak_bytes`) while active.

    Unlike `mpnb.teaching.SavedTensorMeter` (everything one forward saved), this follows
    the activations as backwards free them: a pipeline schedule that runs a microbatch's
    backward early (1F1B) peaks lower than one that keeps every microbatch's activations
    until all forwards are done (GPipe). A storage saved several times counts once.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.peak_bytes = 0
        self._refs: dict[StorageKey, int] = {}
        self._hooks: Any = None

    def _pack(self, t: Any) -> _Saved:
        key = saved_storage(t)
        if key is not None:
            if not self._refs.get(key):
                self.bytes += key[1]
                self.peak_bytes = max(self.peak_bytes, self.bytes)
            self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(self, t, key)

    def _release(self, key: StorageKey) -> None:
        left = self._refs.get(key, 0) - 1
        if left > 0:
            self._refs[key] = left
            return
        if self._refs.pop(key, None) is not None:
            self.bytes -= key[1]

    def __enter__(self) -> LiveActivationMeter:
        import torch

        self.peak_bytes = self.bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class ActivationTracker:
    """The peak activation bytes of the last tracked `Trainer.step`, for the memory chart."""

    def __init__(self) -> None:
        self.last_peak = 0  # the peak of the last tracked step that finished
        self._meter: LiveActivationMeter | None = None  # the tracked step running now

    @property
    def current(self) -> int:
        """Bytes held for backward right now, in a tracked step (0 outside one)."""
        return self._meter.bytes if self._meter is not None else 0

    @property
    def peak(self) -> int:
        """What the chart shows: the last finished step's peak, or the running one during the first."""
        return self.last_peak or (self._meter.peak_bytes if self._meter is not None else 0)

    @contextlib.contextmanager
    def step(self, index: int = 0) -> Iterator[None]:
        """Count what the code inside saves for backward; its peak becomes `last_peak` at the end.

        `index`: the optimizer step about to run; only the first and then one in `EVERY` are counted.
        """
        if index >= FIRST_STEPS and index % EVERY:
            yield
            return
        self._meter = LiveActivationMeter()
        try:
            with self._meter:
                yield
            self.last_peak = self._meter.peak_bytes
        finally:
            self._meter = None  # a graph kept with retain_graph is not this chart's business
