"""Measuring tools the teaching notebooks run inside `%%distributed` cells (engine side).

`SavedTensorMeter` (bytes autograd keeps for backward), `LiveActivationMeter`
(those still alive, and their peak, as backwards free them; it lives in
`mpnb.engine.activations`, which the memory chart shares), `gathered_parameter_bytes`
(FSDP parameters currently unsharded), `StageTimer` (busy intervals of one
pipeline stage, per microbatch) with `sync_clock` (one time axis for every rank)
and `pipeline_steps` (both, plus live activations, for a few training steps).
torch is imported only when they are called: the notebooks
import them through `mpnb.teaching`, which the kernel imports too.
The pipeline timeline they measure is drawn by `mpnb.widgets.timeline`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from mpnb.engine.activations import LiveActivationMeter, saved_storage

# ---------------------------------------------------------------------------- activations


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward while active: the activation memory of a forward.

    Parameters (and views of them) are not counted: they are held anyway. Each
    storage is counted once. Under activation checkpointing the checkpointed
    region's own hooks take over, so only what survives outside it is counted.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self._seen: set[tuple[int, int]] = set()
        self._hooks: Any = None

    def _pack(self, t: Any) -> Any:
        key = saved_storage(t)
        if key is not None and key not in self._seen:
            self._seen.add(key)
            self.bytes += key[1]
            self.tensors += 1
        return t

    def __enter__(self) -> SavedTensorMeter:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def gathered_parameter_bytes(model: Any) -> int:
    """Bytes of `model`'s parameters that are plain (unsharded) tensors right now.

    Under FSDP2 every parameter is a sharded DTensor between steps; during a
    step the parameters of a unit are all-gathered into plain tensors. Called
    between forward and backward this shows what `reshard_after_forward=False`
    keeps.
    """
    total = 0
    for p in model.parameters():
        if not hasattr(p, "to_local") and p.untyped_storage().nbytes():
            total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------- pipeline timelines


class StageTimer:
    """Busy intervals of one pipeline stage: (kind, microbatch, start, end), kind "F" or "B".

    Wraps the stage's `forward_one_chunk` and `backward_one_chunk` (what every
    `torch.distributed.pipelining` schedule calls per microbatch), so the
    intervals are compute only: waiting for activations or gradients from the
    neighbouring stage falls between them and shows as idle time. Times are
    `time.perf_counter()` seconds; subtract `sync_clock()` to compare ranks.
    `stage` is a `PipelineStage` (mpnb's pipeline trainer: `trainer.schedule._stage`).
    """

    _METHODS = (("F", "forward_one_chunk"), ("B", "backward_one_chunk"))

    def __init__(self, stage: Any) -> None:
        self.events: list[tuple[str, int, float, float]] = []
        self._stage = stage
        for kind, name in self._METHODS:
            setattr(stage, name, self._timed(kind, getattr(stage, name)))

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            try:
                return fn(chunk_id, *args, **kwargs)
            finally:
                self._sync()
                self.events.append((kind, int(chunk_id), start, time.perf_counter()))

        return timed

    def _sync(self) -> None:
        # GPU kernels run asynchronously: without a sync the boxes would show launch times only
        import torch

        device = getattr(self._stage, "device", None)
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    def reset(self) -> None:
        self.events.clear()

    def remove(self) -> None:
        for _, name in self._METHODS:
            self._stage.__dict__.pop(name, None)  # back to the class's method


def sync_clock() -> float:
    """A barrier, then this rank's `perf_counter()`: subtract it to put every rank on one time axis."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter()


def pipeline_steps(trainer: Any, batches: Any) -> list[dict[str, Any]]:
    """`trainer.step` on each batch, timed per microbatch and stage: what notebook 04 measures.

    Per step: `events` (this stage's (kind, microbatch, start, end), seconds
    from a barrier just before the step, so every rank shares the origin),
    `peak_activation_bytes` (the most activation bytes alive at once on this
    stage) and `loss`. `trainer` is a pipeline `Trainer`; warm it up first.
    """
    timer = StageTimer(trainer.schedule._stage)
    steps = []
    try:
        for batch in batches:
            timer.reset()
            t0 = sync_clock()
            with LiveActivationMeter() as live:
                loss = trainer.step(batch)
            steps.append({"events": [(k, mb, s - t0, e - t0) for k, mb, s, e in timer.events],
                          "peak_activation_bytes": live.peak_bytes, "loss": loss})
    finally:
        timer.remove()
    return steps
