"""Pieces every strategy needs: where this rank sits, the device mesh, blocks, optimizers."""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.errors import MpnbError


@dataclass
class EngineContext:
    """Where this rank sits: its global rank, the world, and its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def build_mesh(ctx: EngineContext, *, pp: int = 1, dp: int = 1, tp: int = 1) -> Any:
    """A device mesh with named dims ("pp", "dp", "tp"), pipeline outermost as in torchtitan.

    Tensor-parallel ranks are neighbours (their collectives run every layer),
    pipeline stages are furthest apart (they exchange one activation per microbatch).
    """
    from torch.distributed.device_mesh import init_device_mesh

    assert pp * dp * tp == ctx.world_size, (pp, dp, tp, ctx.world_size)
    return init_device_mesh(ctx.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def find_blocks(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's repeated blocks: (name, container) of its largest ModuleList/Sequential of one class.

    GPT-style models keep their transformer blocks in one such container
    (`blocks`, `layers`, `h`, `transformer.h`); FSDP shards one unit per block
    and the pipeline splitter cuts between blocks.
    """
    best: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        # ModuleDict too: a pipeline stage keeps its blocks in one, keyed by their original index
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(module) >= 2:
            classes = {type(m) for m in module.children()}
            if len(classes) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    return best


def modules_by_class(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Submodules whose class name is one of `class_names`; unknown names -> MpnbError with close ones."""
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in class_names if c not in present]
    if missing:
        hints = {c: difflib.get_close_matches(c, present, n=3) for c in missing}
        raise MpnbError(
            "fsdp_wrap names module classes this model does not have: "
            + "; ".join(f"{c!r} (close: {', '.join(h) or 'none'})" for c, h in hints.items())
            + f". Classes in the model: {', '.join(sorted(present))}."
        )
    return [m for m in model.modules() if type(m).__name__ in class_names]


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

    found = find_blocks(model)
    targets = list(found[1].children()) if found else [model]
    for block in targets:
        checkpoint(block)
