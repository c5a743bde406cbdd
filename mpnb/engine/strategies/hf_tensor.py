"""Tensor parallelism of a transformers model with transformers' own code and plan.

The plan is the model's `config.base_model_tp_plan` plus its head's entries
(`hf_plans.tensor_plan`; mpnb's encoder plan for BERT-style models, which
ship none). `model._resolve_parallel_plans` expands it to one entry per module
and parameter, and `transformers.distributed.tensor_parallel.apply_tensor_parallelism`
turns the projections into DTensor shards with the forward hooks that move
activations between layouts. Attention reshapes by head size (`view(..., -1,
head_dim)`), so each rank runs its own 1/tp of the query and key/value heads;
`hf_plans.check_tensor_parallel` makes sure both counts divide. Norms stay
plain tensors, replicated on every rank.

Sharding slices each rank's own copy of the weights (no broadcast), so every
rank must build identical weights: the same seed, or the same `from_pretrained`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mpnb.planning import hf_plans


def resolved_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """One TP style per module and parameter name (`model.layers.3.self_attn.q_proj.weight`: "colwise")."""
    from transformers.distributed import DistributedConfig

    override = None if hf_plans.has_own_tensor_plan(model) else hf_plans.tensor_plan(model)
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp, tp_plan=override))
    return plan


def apply_hf_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard `model` over `tp_mesh` with transformers' TP, keeping tied weights (embeddings, head) tied."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan = resolved_plan(model, tp_mesh.size())
    # a tied head weight (Qwen2, BERT's MLM decoder) is one parameter listed under two names; shard it
    # once through the module that owns it, then tie again (embedding and head both shard the vocab dim)
    owned = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    plan = {name: style for name, style in plan.items() if not (name in every and name not in owned)}
    apply_tensor_parallelism(model, tp_mesh, plan)
    if len(every) != len(owned):
        model.tie_weights()
    keep_gradients_sharded(model)


def keep_gradients_sharded(model: nn.Module) -> None:
    """Store each DTensor parameter's gradient in the parameter's own layout.

    The vocabulary-sharded embedding's backward yields a replicated gradient
    (the full table on every rank). Slicing it to the parameter's shard needs no
    communication, and makes each rank hold 1/tp of that gradient, as planned.
    """
    from torch.distributed.tensor import DTensor

    def reshard(param: Any) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(reshard)
