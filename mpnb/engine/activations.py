"""Activation bytes a training step keeps for backward, tracked for the memory chart.

On CPU there is no allocator to ask what activations hold, and on GPU torch's counters
do not say which allocations are activations. `ActivationTracker` counts what autograd
saves for backward (saved-tensor hooks around each `Trainer.step`): a storage adds its
bytes when first saved and gives them back when the last tensor saved on it is unpacked
in backward. The step's peak of that running total is what the chart stacks as
"activations (tracked)". Parameters, and views of them, are not counted: they are held
anyway. What autograd does not save (a forward's temporaries, communication buffers) is
not counted either, so this is a lower bound. The hooks cost one Python call per saved
tensor, ~10% of a tiny model's CPU step, so only the first steps and then one in `EVERY`
are tracked: with fixed batch shapes the peak repeats.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# (storage pointer, storage bytes): one entry per storage however many tensors share it
_Key = tuple[int, int]
FIRST_STEPS = 3  # tracked every time (shapes and the optimizer's state settle)
EVERY = 16  # then one step in this many


class ActivationTracker:
    """Running and peak bytes of the storages autograd holds for backward during a step."""

    def __init__(self) -> None:
        self.current = 0
        self.step_peak = 0  # the peak of the step running now
        self.last_peak = 0  # the peak of the last step that finished
        self._refs: dict[_Key, int] = {}

    @property
    def peak(self) -> int:
        """What the chart shows: the last finished step's peak, or the running one during the first."""
        return max(self.last_peak, self.step_peak) if self.last_peak == 0 else self.last_peak

    def _key(self, t: torch.Tensor) -> _Key | None:
        base = t._base if t._base is not None else t
        if isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
            return None
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (tensor parallel)
        storage = local.untyped_storage()
        size = storage.nbytes()
        return (storage.data_ptr(), size) if size else None

    def _pack(self, t: torch.Tensor) -> tuple[_Key | None, torch.Tensor]:
        try:
            key = self._key(t)
        except Exception:  # a tensor subclass without a storage: not counted, never an error
            key = None
        if key is not None:
            refs = self._refs.get(key, 0)
            if refs == 0:
                self.current += key[1]
                self.step_peak = max(self.step_peak, self.current)
            self._refs[key] = refs + 1
        return key, t

    def _unpack(self, packed: tuple[_Key | None, torch.Tensor]) -> torch.Tensor:
        key, t = packed
        refs = self._refs.get(key, 0) if key is not None else 0
        if refs == 1:
            del self._refs[key]  # type: ignore[arg-type]
            self.current -= key[1]  # type: ignore[index]
        elif refs > 1:
            self._refs[key] = refs - 1  # type: ignore[index]
        return t

    @contextlib.contextmanager
    def step(self, index: int = 0) -> Iterator[None]:
        """Count what the code inside saves for backward; the peak becomes `last_peak` at the end.

        `index`: the optimizer step about to run; only the first and then one in `EVERY` are counted.
        """
        if index >= FIRST_STEPS and index % EVERY:
            yield
            return
        self.current, self.step_peak = 0, 0
        self._refs.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self.last_peak = self.step_peak
        self._refs.clear()  # a graph kept with retain_graph is not this chart's business
        self.current = 0

