"""Tensor parallelism (Megatron style) with `torch.distributed.tensor.parallel`.

Inside each block the first matmul of a pair is split by output features
(colwise: every rank computes some heads / some hidden units) and the second
by input features (rowwise: partial sums, all-reduced once). So a block costs
one all-reduce in forward and one in backward, and each rank holds 1/tp of
those weights. Everything else (embeddings, layer norms, the LM head) stays
replicated. With more ranks than `tensor_parallel`, the remaining dimension is
data parallel with FSDP2 on the same 2-D mesh (torchtitan's TP, then FSDP).
A transformers model is split by transformers' own plan and code
(`hf_tensor`), unless `config.tensor_plan` names layers itself.

Memory: sharded weights count their DTensor local shard, replicated ones count
fully; P = G = 4 bytes (fp32; bf16 uses autocast), K = 8 for AdamW.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn
from torch.optim import Optimizer

from mpnb.engine.strategies.common import (
    EngineContext,
    apply_activation_checkpointing,
    close_names,
    parameter_names,
    trainer_on_mesh,
)
from mpnb.engine.strategies.fsdp import FSDPTrainer, apply_fsdp
from mpnb.engine.strategies.hf_tensor import apply_hf_tensor_parallel
from mpnb.engine.trainer import LossFn, Trainer, low_precision_dtype
from mpnb.errors import MpnbError
from mpnb.planning import hf_plans
from mpnb.planning.config import Config
from mpnb.planning.model_shape import default_tensor_plan
from mpnb.planning.parallel_dims import TENSOR_STYLES, ParallelDims

_HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads")


class TensorTrainer(FSDPTrainer):
    strategy = "tensor"


def default_plan(model: nn.Module) -> dict[str, str]:
    """Colwise/rowwise styles for known attention and MLP layers, or Linear pairs of a Sequential.

    The estimator reads the same plan (`mpnb.planning.model_shape.default_tensor_plan`).
    """
    return default_tensor_plan(model)


def check_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, str]:
    """Raise MpnbError for names that match no module, non-Linear targets or unsplittable sizes."""
    if not plan:
        raise MpnbError(
            f"No tensor-parallel plan for {type(model).__name__}: none of its Linear layers has a known "
            "name (qkv/proj/fc, q_proj/o_proj, up_proj/down_proj, fc1/fc2). Set config.tensor_plan, e.g. "
            "{'blocks.*.mlp.fc': 'colwise', 'blocks.*.mlp.proj': 'rowwise'}."
        )
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    for pattern, style in plan.items():
        if style not in TENSOR_STYLES:
            raise MpnbError(f"tensor_plan[{pattern!r}] = {style!r}: use 'colwise' or 'rowwise'.")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise MpnbError(
                f"tensor_plan names {pattern!r}, which matches no module of {type(model).__name__}. "
                f"Close names: {close_names(pattern, names)}. Module names are dotted paths as in "
                "model.named_modules(); '*' matches one level (e.g. 'blocks.*.mlp.fc')."
            )
        for name in matched:
            layer = modules[name]
            if not isinstance(layer, (nn.Linear, nn.Embedding)):
                raise MpnbError(
                    f"tensor_plan entry {name!r} is a {type(layer).__name__}; only nn.Linear and "
                    "nn.Embedding layers can be split colwise/rowwise. Name the Linear layers inside it."
                )
            size = layer.weight.shape[0 if style == "colwise" else 1]
            if isinstance(layer, nn.Linear) and size % tp:
                raise MpnbError(
                    f"{name} ({style}) splits a dimension of {size} features, which does not divide by "
                    f"tensor_parallel={tp}. Use a tensor_parallel that divides {size}, or leave it out of "
                    "the plan."
                )
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: dict[str, str]) -> None:
    """Shard the planned layers over `tp_mesh` and divide attention head counts by the TP degree."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in plan.items()})
    tp = tp_mesh.size()
    for module in model.modules():  # attention reshapes by head count: each rank now has 1/tp of them
        for attr in _HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and value % tp == 0 and _has_colwise_child(module, plan, model):
                setattr(module, attr, value // tp)


def _has_colwise_child(module: nn.Module, plan: dict[str, str], root: nn.Module) -> bool:
    names = {id(m): n for n, m in root.named_modules()}
    prefix = names.get(id(module), "")
    for child_name, _ in module.named_children():
        full = f"{prefix}.{child_name}" if prefix else child_name
        if any(fnmatch.fnmatchcase(full, p) and s == "colwise" for p, s in plan.items()):
            return True
    return False


def check_hf_model(model: nn.Module, tp: int) -> None:
    """MpnbError (before any collective) when a transformers model has no plan or its heads don't divide."""
    why = hf_plans.missing_tensor_plan(model)
    if why is not None:
        own = "" if hf_plans.has_conv1d(model) else ", or give config.tensor_plan naming its nn.Linear layers"
        raise MpnbError(
            f"{why}. Use strategy=fsdp or zero to shard it instead (tensor parallel runs Llama-family models "
            f"and BERT-style encoders){own}."
        )
    hf_plans.check_tensor_parallel(model, tp)


def prepare(
    model: nn.Module,
    optimizer: Optimizer,
    config: Config,
    dims: ParallelDims,
    ctx: EngineContext,
    loss_fn: LossFn | None,
) -> Trainer:
    # checked before any collective, so every rank fails the same way
    hf = not config.tensor_plan and hf_plans.is_transformers_model(model)
    if hf:
        check_hf_model(model, dims.tp)
    else:
        plan = check_plan(model, dict(config.tensor_plan) or default_plan(model), dims.tp)
    names = parameter_names(model)
    model.to(ctx.device)
    mesh = dims.build_mesh(ctx.device.type)
    if hf:
        apply_hf_tensor_parallel(model, mesh["tp"])
    else:
        apply_tensor_parallel(model, mesh["tp"], plan)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    autocast_dtype = low_precision_dtype(config.precision)
    if dims.dp > 1:
        apply_fsdp(model, mesh["dp"], config)
        autocast_dtype = None  # FSDP2's MixedPrecisionPolicy does the casting
    return trainer_on_mesh(TensorTrainer, model, optimizer, names, mesh, config, dims, ctx, loss_fn,
                           autocast_dtype=autocast_dtype)
