"""DDP: every rank holds the whole model; gradients are averaged with all-reduce.

Memory per rank (ZeRO paper's accounting, what the tensors show): parameters
P·Ψ, gradients G·Ψ, optimizer K·Ψ with P = G = 4 bytes in fp32 and in bf16
(autocast keeps fp32 parameters and gradients; only activations are bf16), and
K = 8 for AdamW (exp_avg + exp_avg_sq, fp32), 4 for SGD with momentum, 0 for
plain SGD. Gradients are views into DDP's communication buckets
(`gradient_as_bucket_view=True`), so the buckets cost nothing extra.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from mpnb.engine.strategies.common import EngineContext, apply_activation_checkpointing
from mpnb.engine.trainer import LossFn, Trainer, low_precision_dtype
from mpnb.planning.config import Config
from mpnb.planning.parallel_dims import ParallelDims


class DDPTrainer(Trainer):
    strategy = "ddp"

    def _no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        if sync or not isinstance(self.model, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.model.no_sync()


def prepare(
    model: nn.Module,
    optimizer: Optimizer,
    config: Config,
    dims: ParallelDims,
    ctx: EngineContext,
    loss_fn: LossFn | None,
) -> Trainer:
    model.to(ctx.device)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    autocast_dtype = low_precision_dtype(config.precision)
    if not ctx.distributed:  # one process, no process group: train the model as it is
        return DDPTrainer(
            model, optimizer, config, dims, loss_fn, device=ctx.device, autocast_dtype=autocast_dtype
        )
    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    return DDPTrainer(
        ddp,
        optimizer,
        config,
        dims,
        loss_fn,
        device=ctx.device,
        dp_rank=ctx.rank,
        autocast_dtype=autocast_dtype,
    )
