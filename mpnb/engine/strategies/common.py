"""Pieces every strategy needs: where this rank sits, optimizers over new parameters, checkpointing.

Which modules are the repeated blocks (FSDP units, checkpointed blocks,
pipeline cuts) is decided in `mpnb.planning.model_shape`, the same functions
the estimator reads; the device mesh comes from `ParallelDims.build_mesh`.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.engine.trainer import LossFn, Trainer
from mpnb.planning.config import Config
from mpnb.planning.model_shape import block_modules
from mpnb.planning.parallel_dims import ParallelDims


@dataclass
class EngineContext:
    """Where this rank sits: its global rank, the world, and its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def close_names(name: str, names: list[str], n: int = 3) -> str:
    found = difflib.get_close_matches(name, names, n=n, cutoff=0.5)
    return ", ".join(found) if found else "none close"


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, names_by_id: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyperparameters) over `model`'s current parameters.

    FSDP2 and tensor parallelism replace parameters with DTensors and a pipeline
    stage keeps only some of them, so an optimizer built before `prepare` points
    at tensors nobody updates any more. Parameters are matched by name.
    """
    current = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        params = [current[names_by_id[id(p)]] for p in group["params"] if names_by_id.get(id(p)) in current]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not groups:  # a stage with no parameters still needs an optimizer object
        groups = [{"params": [], **{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}}]
    accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold internal keys
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def clean_name(name: str) -> str:
    """Parameter names as the unwrapped model has them (no DDP/compile/checkpoint prefixes)."""
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Uses torch's composable `checkpoint`, which keeps parameter names unchanged
    (a wrapper module would add a prefix and break loading across strategies).
    """
    from torch.distributed._composable import checkpoint

    for block in block_modules(model) or [model]:
        checkpoint(block)


def trainer_on_mesh(
    trainer_cls: type[Trainer],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    mesh: Any,
    config: Config,
    dims: ParallelDims,
    ctx: EngineContext,
    loss_fn: LossFn | None,
    *,
    autocast_dtype: torch.dtype | None,
    **extra: Any,
) -> Trainer:
    """A `trainer_cls` over `model` whose data-parallel rank and group are the mesh's "dp" dim.

    The optimizer is rebuilt over the model's current (sharded, split) parameters,
    matched by the names they had before (`names`, from `parameter_names`).
    """
    return trainer_cls(
        model,
        rebuild_optimizer(optimizer, names, model),
        config,
        dims,
        loss_fn,
        device=ctx.device,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_group=mesh["dp"].get_group(),
        autocast_dtype=autocast_dtype,
        **extra,
    )
