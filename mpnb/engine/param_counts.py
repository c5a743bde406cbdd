"""How many parameters the model has, and how many of them this rank holds.

`model.num_parameters()` (or `sum(p.numel() ...)`) misleads once a strategy
has split the model: DeepSpeed ZeRO-3 leaves each parameter an empty
placeholder and keeps the rank's partition in `p.ds_tensor` (so the count is
0), FSDP2 and tensor parallelism turn parameters into DTensors whose
`numel()` is the full size while `to_local()` is the rank's shard, and a
pipeline stage holds only its own blocks. `count_parameters` reads each of
these correctly; `Trainer.parameter_counts()` uses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParameterCounts:
    """`total`: parameters of the whole model; `local`: the elements this rank holds, without padding."""

    total: int
    local: int
    held_as: str = ""  # what the local part is, e.g. "its ZeRO-3 partition"

    def __str__(self) -> str:
        if self.local == self.total:
            return f"{self.total:,} parameters, all held on this rank"
        how = f" ({self.held_as})" if self.held_as else ""
        return f"{self.total:,} parameters, {self.local:,} held on this rank{how}"


def full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter: ZeRO-3's `ds_numel`, a DTensor's global size, else numel()."""
    ds_numel = getattr(p, "ds_numel", None)
    return int(ds_numel) if ds_numel is not None else int(p.numel())


def local_numel(p: torch.Tensor) -> int:
    """Elements of `p` this rank holds: its ZeRO-3 partition (padding left out), DTensor shard, or all."""
    partition = getattr(p, "ds_tensor", None)
    if partition is not None and not getattr(p, "ds_persist", False):
        size = int(getattr(partition, "ds_numel", partition.numel()))
        group = getattr(p, "ds_process_group", None)
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        # the last ranks' partitions are padded to equal size: count only real elements
        return max(0, min(size, full_numel(p) - rank * size))
    if hasattr(p, "to_local"):  # DTensor (FSDP2, tensor parallel)
        return int(p.to_local().numel())
    return int(p.numel())


def count_parameters(params: Iterable[torch.Tensor], total: int | None = None,
                     held_as: str = "") -> ParameterCounts:
    """Full and local counts of `params` (shared ones once); `total` overrides the full count.

    Give `total` where the parameters are only part of the model (a pipeline stage).
    """
    unique = list({id(p): p for p in params}.values())
    full = sum(full_numel(p) for p in unique)
    return ParameterCounts(total=full if total is None else int(total),
                           local=sum(local_numel(p) for p in unique), held_as=held_as)


def held_as(strategy: str, zero_stage: int, dp: int, stage_index: int | None = None) -> str:
    """Words for what a rank holds of the model under `strategy`, for `ParameterCounts.held_as`."""
    if strategy == "zero":
        return "its ZeRO-3 partition" if zero_stage == 3 else ""
    if strategy == "fsdp":
        return "its FSDP shard"
    if strategy == "tensor":
        return "its tensor-parallel shard" + (", sharded again by FSDP" if dp > 1 else "")
    if strategy == "pipeline":
        return f"pipeline stage {stage_index}" + (", sharded by FSDP" if dp > 1 else "")
    return ""
