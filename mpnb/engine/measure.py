"""The engine half of `mpnb.compare`: what one config's run of a training cell measured on this rank.

The kernel `arm`s every rank before the cell runs under a config and
`collect`s after it. While armed, `Trainer.step` hands each step to
`StepMeasure.observe`: the first `warmup` steps are not timed, and the last of
them runs under `count_collectives` (so the profiler never slows a timed step);
the next `steps` are timed; after the last timed step the rank's memory by
category is read. Later steps run as usual.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from mpnb.engine import state
from mpnb.engine.comm_count import count_collectives


class StepMeasure:
    """Times, losses, collectives and memory of the steps one training cell takes on this rank."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.taken = 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.comm: dict[str, dict[str, float]] | None = None
        self.memory: dict[str, int] | None = None
        self.peak_allocated: int | None = None  # CUDA only: the allocator's high-water mark
        # rows this rank ran per step, and the rows the estimate assumed (micro_batch_size x grad_accum_steps)
        self.rows: int | None = None
        self.rows_predicted: int | None = None

    def observe(self, trainer: Any, batch: Any, sharded: bool, run_step: Callable[[], float]) -> float:
        index = self.taken
        self.taken += 1
        if self.rows is None:
            rows = batch_rows(batch)
            self.rows = rows if sharded or rows is None else rows // max(trainer.dp_size, 1)
            self.rows_predicted = trainer.config.micro_batch_size * trainer.config.grad_accum_steps
        if index == self.warmup - 1:
            with count_collectives() as counted:
                loss = run_step()
            self.comm = counted.as_data()
        elif self.warmup <= index < self.warmup + self.steps:
            _sync(trainer)
            start = time.perf_counter()
            loss = run_step()
            _sync(trainer)
            self.times.append(time.perf_counter() - start)
        else:
            loss = run_step()
        self.losses.append(float(loss))
        if index == self.warmup + self.steps - 1:
            self.memory = trainer.memory_breakdown()
            if trainer.device.type == "cuda":
                self.peak_allocated = torch.cuda.max_memory_allocated(trainer.device)
        return loss

    def result(self) -> dict[str, Any]:
        """Plain data for the kernel."""
        return {
            "rank": state.rank, "taken": self.taken, "times": self.times, "losses": self.losses,
            "comm": self.comm or {}, "memory": self.memory, "peak_allocated": self.peak_allocated,
            "rows": self.rows, "estimate": self._rank_estimate(),
            "estimate_comm": dict(state.last_estimate.comm_bytes_per_step) if state.last_estimate else {},
            "capacity": _capacity(),
            "num_params": state.last_estimate.num_params if state.last_estimate else None,
        }

    def _rank_estimate(self) -> dict[str, int] | None:
        """`mpnb.estimate`'s bytes for this rank, its activations scaled to the rows the cell really ran.

        The estimate assumed `micro_batch_size` rows per rank; the cell's batches decide (the same
        global batch is fewer rows per rank under data parallelism), and activations grow linearly
        with the rows (Korthikanti et al.), so they are scaled by rows run / rows assumed.
        """
        estimate = state.last_estimate
        if estimate is None or state.rank >= len(estimate.ranks):
            return None
        r = estimate.ranks[state.rank]
        activations = r.activations
        if self.rows and self.rows_predicted:
            activations = round(activations * self.rows / self.rows_predicted)
        return {**r.held(), "activations": activations, "buffers": r.buffers,
                "total": r.total - r.activations + activations}


def batch_rows(batch: Any) -> int | None:
    """Rows (dim 0) of a batch: a tensor, or the first tensor of a tuple, list or dict; None if none."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        rows = batch_rows(item)
        if rows is not None:
            return rows
    return None


def _capacity() -> int | None:
    """Bytes of this rank's GPU; None on CPU ranks (then every config "fits")."""
    if state.device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.device(state.device)).total_memory)
    return None


def _sync(trainer: Any) -> None:
    if trainer.device.type == "cuda":  # kernels run asynchronously: time the work, not its launch
        torch.cuda.synchronize(trainer.device)


def arm(warmup: int, steps: int, seed: int) -> None:
    """Measure the next training cell's steps; every config starts from the same seeds."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    if torch.cuda.is_available() and state.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    state.last_estimate = None  # a cell that fails before its prepare must not show the last config's
    state.step_observer = StepMeasure(warmup, steps)


def collect() -> dict[str, Any] | None:
    """What the armed run measured on this rank (None if nothing was armed); disarms."""
    observer, state.step_observer = state.step_observer, None
    return observer.result() if observer is not None else None
