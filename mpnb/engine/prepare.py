"""`mpnb.prepare(model, optimizer)`: apply the active config and return a `Trainer`.

Runs on every engine (rank) with the same arguments. The config defaults to
the session's active one (`mpnb.engine.state.config`, pushed by `%mpnb config`
or the panel). Structural checks (a model the pipeline cannot split, a tensor
plan naming missing modules) raise `MpnbError` before any collective starts,
so every rank fails the same way and the process group stays usable.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.engine import monitor, state
from mpnb.engine.param_counts import count_parameters
from mpnb.engine.strategies.common import EngineContext
from mpnb.engine.trainer import LossFn, Trainer
from mpnb.errors import ConfigError, MpnbError
from mpnb.planning.config import Config
from mpnb.planning.estimate_result import Estimate
from mpnb.planning.estimator import estimate
from mpnb.planning.parallel_dims import ParallelDims, Strategy

# the module whose `prepare(model, optimizer, config, dims, ctx, loss_fn)` applies each strategy
STRATEGY_MODULES: dict[Strategy, str] = {
    Strategy.DDP: "mpnb.engine.strategies.ddp",
    Strategy.FSDP: "mpnb.engine.strategies.fsdp",
    Strategy.ZERO: "mpnb.engine.strategies.zero",
    Strategy.PIPELINE: "mpnb.engine.strategies.pipeline",
    Strategy.TENSOR: "mpnb.engine.strategies.tensor",
}


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: LossFn | None = None,
    config: Config | dict[str, Any] | None = None,
    lr_scheduler: Any = None,
    resume: str | os.PathLike[str] | None = None,
) -> Trainer:
    """Parallelise `model` (and `optimizer`) under the config and return the Trainer.

    `optimizer` defaults to `torch.optim.AdamW(model.parameters(), lr=1e-3)`.
    Strategies that replace or split parameters (fsdp, tensor, pipeline)
    rebuild it with the same class and hyperparameters: use `trainer.optimizer`
    from here on. `loss_fn(output, targets)` defaults to cross-entropy over the
    last dimension. `trainer.step(batch)` takes the *global* batch on every
    rank (see `Trainer.shard`). `lr_scheduler` (built on `optimizer`) is stepped
    after every optimizer step and saved with checkpoints. `resume=path` loads a
    checkpoint written by `trainer.save` under any strategy and world size.
    """
    cfg = _resolve_config(config)
    ctx = current_context()
    if not isinstance(model, nn.Module):
        raise MpnbError(f"mpnb.prepare needs a torch.nn.Module, got {type(model).__name__}.")
    cfg.validate(ctx.world_size, ctx.device.type)
    dims = ParallelDims.from_config(cfg, ctx.world_size)
    if not ctx.distributed and cfg.strategy != Strategy.DDP:
        raise MpnbError(
            f"strategy={cfg.strategy} needs a process group, and this process has none. Run the cell on "
            "the cluster (`%mpnb start`, then `%%distributed`), or use strategy=ddp to train in one process."
        )
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is not optimizer:
        raise MpnbError("lr_scheduler must be built on the optimizer passed to mpnb.prepare "
                        "(e.g. torch.optim.lr_scheduler.LambdaLR(optimizer, ...)).")
    if resume is not None:
        from mpnb.checkpoints.format import read_manifest

        read_manifest(resume)  # a wrong path fails here, before the model is wrapped
    module = importlib.import_module(STRATEGY_MODULES[Strategy(cfg.strategy)])
    # the chart's line for this model, now rather than after a slow prepare, while the model is whole
    monitor.announce_estimate(_estimate(model, cfg, ctx.world_size))
    total_parameters = count_parameters(model.parameters()).total  # a pipeline stage keeps only its part
    trainer = module.prepare(model, optimizer, cfg, dims, ctx, loss_fn)
    trainer.total_parameters = total_parameters
    trainer.lr_scheduler = _bind_scheduler(lr_scheduler, optimizer, trainer.optimizer)
    state.set_active_trainer(trainer)
    if resume is not None:
        trainer.load(resume)
    return trainer


def _bind_scheduler(scheduler: Any, original: torch.optim.Optimizer, used: Any) -> Any:
    """Point the scheduler at the optimizer the strategy steps (fsdp, tensor, pipeline rebuild it)."""
    if scheduler is None or used is None or _same_groups(original, used):
        return scheduler
    for group, old in zip(used.param_groups, original.param_groups, strict=False):
        group["initial_lr"] = old.get("initial_lr", old["lr"])
        group["lr"] = old["lr"]
    scheduler.optimizer = used
    return scheduler


def _same_groups(a: Any, b: Any) -> bool:
    return len(a.param_groups) == len(b.param_groups) and all(
        x is y for x, y in zip(a.param_groups, b.param_groups, strict=True))


def _estimate(model: nn.Module, cfg: Config, world_size: int) -> Estimate | None:
    """What `mpnb.estimate` predicts for this model; None where it cannot read the model (no line drawn)."""
    try:
        return estimate(model, cfg, world_size)
    except Exception:  # an estimate is a nicety: never fail a prepare over it
        return None


def current_context() -> EngineContext:
    """This rank's place: from the process group when there is one, else one process."""
    device = torch.device(state.device)
    if dist.is_available() and dist.is_initialized():
        return EngineContext(dist.get_rank(), dist.get_world_size(), device)
    return EngineContext(0, 1, device)


def _resolve_config(config: Config | dict[str, Any] | None) -> Config:
    if config is None:
        return Config.from_dict(state.config) if state.config else Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config().update(**config)  # unknown keys and bad values raise ConfigError
    raise ConfigError(f"config must be an mpnb.Config or a dict, got {type(config).__name__}.")
