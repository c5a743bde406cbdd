"""Which parallel strategies a model can run under, and why not where it cannot, in a learner's words.

The panel greys out the strategies a model cannot use and `%mpnb config`
refuses them, with the same one-line reason the engine's MpnbError gives
before any collective. The rules follow what the engine does:

- DDP, FSDP and ZeRO work for any module (they shard or replicate parameters,
  whatever the layers are).
- Tensor parallel needs a plan: a transformers model's own
  (`config.base_model_tp_plan`) or mpnb's for BERT-style encoders
  (`hf_plans.tensor_plan`; GPT-2's Conv1D layers have none), with heads and
  key/value heads divisible by some degree of the world; other models need
  Linear layers with names mpnb knows (`model_shape.default_tensor_plan`:
  mpnb's GPT, Sequential of Linears).
- Pipeline parallel needs stages: a transformers causal LM with a
  `config.base_model_pp_plan`, an nn.Sequential, or blocks in a top-level
  ModuleList (mpnb's GPT).

Torch-free, like the rest of `mpnb.planning`: the kernel imports it.
"""

from __future__ import annotations

from typing import Any

from mpnb.errors import ConfigError, MpnbError
from mpnb.planning import hf_plans
from mpnb.planning.model_shape import default_tensor_plan, find_blocks, is_torch_class

STRATEGIES = ("ddp", "fsdp", "zero", "pipeline", "tensor")
_ALTERNATIVES = {"tensor": "use fsdp or zero", "pipeline": "use ddp, fsdp or zero"}


def strategy_support(
    model: Any, world_size: int | None = None, *, tensor_plan: dict[str, str] | None = None
) -> dict[str, str | None]:
    """{strategy: None when `model` can run under it, else a one-line reason}, for every strategy offered.

    `world_size` adds the checks that depend on it (a tensor-parallel degree
    that divides the attention heads); without it only the model is judged.
    A plan of the user's own (`config.tensor_plan`) lets tensor parallelism
    split any Linear layers. A parameter count or None (no model) supports everything.
    """
    return {s: unsupported_reason(model, s, world_size, tensor_plan=tensor_plan) for s in STRATEGIES}


def unsupported_reason(
    model: Any, strategy: str, world_size: int | None = None, *, tensor_plan: dict[str, str] | None = None
) -> str | None:
    """Why `model` cannot run under `strategy` ("tensor: ..."), or None when it can."""
    if model is None or isinstance(model, int) or strategy not in _ALTERNATIVES:
        return None
    if strategy == "tensor":
        why = _tensor_problem(model, world_size, bool(tensor_plan))
    else:
        why = _pipeline_problem(model)
    if why is None:
        return None
    return f"{strategy}: {why}" if ";" in why else f"{strategy}: {why}; {_ALTERNATIVES[strategy]}"


def config_problem(model: Any, config: Any, world_size: int | None = None) -> str | None:
    """Why `model` cannot run `config` (its strategy, a TP degree that splits heads, too many stages)."""
    plan = dict(config.tensor_plan or {})
    reason = unsupported_reason(model, str(config.strategy), world_size, tensor_plan=plan)
    if reason is not None or not hf_plans.is_transformers_model(model):
        return reason
    try:  # the degree checks the engine makes for a transformers model, before any collective
        if str(config.strategy) == "tensor" and hf_plans.tensor_plan(model) is not None:
            hf_plans.check_tensor_parallel(model, int(config.tensor_parallel))
        if str(config.strategy) == "pipeline":
            hf_plans.check_pipeline(model, int(config.pipeline_stages))
    except MpnbError as exc:
        return str(exc)
    return None


def check_config(model: Any, config: Any, world_size: int | None = None) -> None:
    """ConfigError naming the problem and the fix when `model` cannot run `config` (before engine work)."""
    problem = config_problem(model, config, world_size)
    if problem:
        raise ConfigError(problem if problem.endswith(".") else f"{problem}.")


def describe_support(model: Any, world_size: int | None = None) -> str:
    """What `%mpnb config --model` prints: the strategies `model` can use, and why not the others."""
    support = strategy_support(model, world_size)
    ok = [s for s, reason in support.items() if reason is None]
    name = type(model).__name__
    if len(ok) == len(support):
        return f"{name} can run under every strategy: {', '.join(ok)}."
    refused = "".join(f"\n  {reason}" for reason in support.values() if reason)
    return f"{name} can run under {', '.join(ok)}; not under:{refused}"


def _tensor_problem(model: Any, world_size: int | None, own_plan: bool) -> str | None:
    name = type(model).__name__
    if hf_plans.is_transformers_model(model):
        missing = hf_plans.missing_tensor_plan(model)
        if missing is None:
            return _heads_problem(model, world_size)
        # a plan of the user's own splits nn.Linear layers, never GPT-2's Conv1D
        return missing if hf_plans.has_conv1d(model) or not own_plan else None
    if not own_plan and not default_tensor_plan(model):
        return (f"{name} has no Linear layers mpnb knows how to split (qkv/proj/fc, q_proj/o_proj, "
                "up_proj/down_proj, fc1/fc2); set config.tensor_plan, or use fsdp or zero")
    return None


def _heads_problem(model: Any, world_size: int | None) -> str | None:
    """No tensor-parallel degree of this world (2..world_size, dividing it) keeps whole heads per rank."""
    heads, kv_heads = hf_plans.attention_heads(model)
    if not world_size or world_size < 2 or not heads:
        return None
    degrees = [d for d in range(2, world_size + 1) if world_size % d == 0]
    if any(heads % d == 0 and (kv_heads or heads) % d == 0 for d in degrees):
        return None
    return (f"{type(model).__name__} has {heads} attention heads and {kv_heads} key/value heads, and no "
            f"tensor-parallel degree of {world_size} ranks ({', '.join(map(str, degrees))}) divides both")


def _pipeline_problem(model: Any) -> str | None:
    name = type(model).__name__
    if hf_plans.is_transformers_model(model):  # the reasons hf_plans.check_pipeline raises in the engine
        return hf_plans.pipeline_problem(model)
    if is_torch_class(model, "Sequential"):
        return None if len(model) >= 2 else f"{name} has fewer than 2 layers to put on 2 stages"
    found = find_blocks(model)
    top = dict(model.named_children())
    if found is None or found[0] not in top or not is_torch_class(found[1], "ModuleList"):
        where = f" (its repeated blocks {found[0]!r} sit inside another module)" if found else ""
        return (f"the pipeline splitter cannot split {name}{where}: it needs an nn.Sequential or blocks in "
                "a top-level nn.ModuleList, like mpnb.models.GPT")
    return None
