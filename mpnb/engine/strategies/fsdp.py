"""FSDP2: `fully_shard` each block, then the root, on the data-parallel mesh dim.

Every parameter becomes a DTensor sharded on dim 0 across the data-parallel
ranks; gradients and AdamW state follow the parameters' sharding. Memory per
rank is (P + G + K)·Ψ/N, counted from the DTensors' local shards:
P = G = 4 (fp32 sharded parameters and gradients, also under bf16 mixed
precision, where only the all-gathered compute copy is bf16 and is freed after
use), K = 8 for AdamW. `reshard_after_forward=False` keeps the gathered
parameters from forward to backward (ZeRO-2 like); between steps they are
sharded either way.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from mpnb.engine.strategies.common import (
    EngineContext,
    apply_activation_checkpointing,
    parameter_names,
    trainer_on_mesh,
)
from mpnb.engine.trainer import LossFn, Trainer, low_precision_dtype
from mpnb.errors import MpnbError
from mpnb.planning.config import Config
from mpnb.planning.model_shape import shard_units
from mpnb.planning.parallel_dims import ParallelDims


class FSDPTrainer(Trainer):
    strategy = "fsdp"

    def _no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()


def apply_fsdp(model: nn.Module, dp_mesh: Any, config: Config) -> nn.Module:
    """Shard `model` over `dp_mesh` (the dp dim of the mesh): each unit of `shard_units`, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": config.reshard_after_forward}
    low = low_precision_dtype(config.precision)
    if low is not None:  # compute in low precision, keep fp32 shards and reduce gradients in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    if config.offload == "parameters":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in shard_units(model, list(config.fsdp_wrap)):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def prepare(
    model: nn.Module,
    optimizer: Optimizer,
    config: Config,
    dims: ParallelDims,
    ctx: EngineContext,
    loss_fn: LossFn | None,
) -> Trainer:
    if config.offload == "parameters" and ctx.device.type == "cpu":
        raise MpnbError(
            "offload=parameters with strategy=fsdp moves FSDP2's shards from the GPU to host memory "
            "(CPUOffloadPolicy), and these ranks already train on the CPU. Use offload=none, or "
            "strategy=zero with offload=optimizer to see DeepSpeed's offload."
        )
    names = parameter_names(model)
    if config.offload != "parameters":
        model.to(ctx.device)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    mesh = dims.build_mesh(ctx.device.type)
    apply_fsdp(model, mesh["dp"], config)
    # FSDP2's MixedPrecisionPolicy casts; autocast on top would cast twice
    return trainer_on_mesh(FSDPTrainer, model, optimizer, names, mesh, config, dims, ctx, loss_fn,
                           autocast_dtype=None)
