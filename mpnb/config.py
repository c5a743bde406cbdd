"""`mpnb.Config`: the one source of truth for how a model is parallelised.

The panel edits it, the magics read it, it travels to the engines as a plain
dict (`to_dict` / `from_dict`) and `mpnb.prepare` reads it there. This module
must not import torch: it is used in the notebook kernel.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

STRATEGIES = ("ddp", "fsdp", "zero", "pipeline", "tensor")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("none", "optimizer", "parameters")


@dataclass
class Config:
    """Every setting of a parallel training run.

    `strategy` picks the data-parallel flavour (ddp, fsdp, zero) or the model
    split (pipeline, tensor); `pipeline_stages` and `tensor_parallel` are the
    model-parallel degrees and the data-parallel degree is what remains of the
    world size (see `data_parallel`).
    """

    strategy: str = "ddp"
    zero_stage: int = 0
    # FSDP2: free the unsharded parameters after forward (ZeRO-3 like) or keep them (ZeRO-2 like)
    reshard_after_forward: bool = True
    # FSDP2: module class names to shard as one unit each; empty = the model's repeated blocks
    fsdp_wrap: list[str] = field(default_factory=list)
    pipeline_stages: int = 1
    pipeline_schedule: str = "gpipe"
    microbatches: int = 1
    # pipeline: module names where a new stage starts; empty = split the sequential blocks evenly
    pipeline_split_points: list[str] = field(default_factory=list)
    tensor_parallel: int = 1
    # tensor: {module path: "colwise" | "rowwise"}; empty = the built-in plan for known layers
    tensor_plan: dict[str, str] = field(default_factory=dict)
    precision: str = "fp32"
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    activation_checkpointing: bool = False
    offload: str = "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
