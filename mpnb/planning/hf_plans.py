"""What a Hugging Face transformers model says about its own parallelism: TP plan, PP plan, blocks, heads.

transformers ships these with the model: `config.base_model_tp_plan` (module
pattern -> "colwise"/"rowwise"/...), resolved with the head's own entries into
`model._tp_plan` (full names, e.g. "model.layers.*.self_attn.q_proj", "lm_head");
`config.base_model_pp_plan` (embeddings, the repeated layers, the final norm)
and `_no_split_modules` (the block class). mpnb uses them instead of plans of
its own, and falls back to its own only where a model has none.

Torch-free: the model is read by duck typing, so the estimator and the panel can
use it on the kernel side.
"""

from __future__ import annotations

from typing import Any

from mpnb.errors import MpnbError


def is_transformers_model(model: Any) -> bool:
    """A `transformers.PreTrainedModel` (recognised along the MRO, without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def no_split_classes(model: Any) -> list[str]:
    """The block classes `_no_split_modules` names that the model really contains (FSDP's units)."""
    if not is_transformers_model(model):
        return []
    named = list(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    return [name for name in named if name in present]


def tensor_plan(model: Any) -> dict[str, str] | None:
    """Full module pattern -> transformers TP style that mpnb applies; None if the model has none.

    The model's own plan where it ships one (Llama, Qwen2, ...), else mpnb's
    plan for BERT-style encoders (`encoder_tensor_plan`); GPT-2 (Conv1D layers) has none.
    """
    if not is_transformers_model(model):
        return None
    if getattr(model.config, "base_model_tp_plan", None):
        return dict(getattr(model, "_tp_plan", None) or {})
    return encoder_tensor_plan(model)


def has_conv1d(model: Any) -> bool:
    """The model keeps weights in transformers' Conv1D (GPT-2's transposed Linear): no plan splits those."""
    return any(type(m).__name__ == "Conv1D" for m in model.modules())


def missing_tensor_plan(model: Any) -> str | None:
    """Why a transformers model has no tensor-parallel plan mpnb can apply ("X has no ..."), or None."""
    if tensor_plan(model) is not None:
        return None
    why = f"{type(model).__name__} has no tensor-parallel plan (transformers' config.base_model_tp_plan)"
    return why + " and its Conv1D layers cannot be split" if has_conv1d(model) else why


def has_own_tensor_plan(model: Any) -> bool:
    """The model ships `config.base_model_tp_plan` (transformers resolves the plan itself)."""
    return is_transformers_model(model) and bool(getattr(model.config, "base_model_tp_plan", None))


# BERT-style encoder layers (BertLayer, RobertaLayer, ...): nn.Linear projections whose attention
# reshapes by head size (view(..., -1, head_size)), so each rank's half of the heads just works
_ENCODER_STYLES = {
    "attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
    "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise",
}


def encoder_tensor_plan(model: Any) -> dict[str, str] | None:
    """mpnb's plan for a BERT-style encoder without a transformers plan; None when the layers don't fit.

    Patterns use `*` for the layer number, as transformers' plans do
    ("bert.encoder.layer.*.attention.self.query": "colwise").
    """
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if type(module).__name__ != "Linear" or ".layer." not in name:
            continue
        prefix, _, rest = name.partition(".layer.")
        index, _, suffix = rest.partition(".")
        style = _ENCODER_STYLES.get(suffix)
        if index.isdigit() and style:
            plan[f"{prefix}.layer.*.{suffix}"] = style
    # a whole attention + MLP pair per layer, or nothing (half a plan would split one matmul only)
    return plan if len(plan) == len(_ENCODER_STYLES) else None


def pipeline_plan(model: Any) -> dict[str, Any] | None:
    """`config.base_model_pp_plan` (base-model child -> (inputs, outputs)); None if the model has none."""
    if not is_transformers_model(model):
        return None
    return dict(getattr(model.config, "base_model_pp_plan", None) or {}) or None


def attention_heads(model: Any) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) from the config; kv heads equal query heads without GQA."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv_heads


def check_tensor_parallel(model: Any, tp: int) -> None:
    """MpnbError when `tp` does not divide the attention heads or the key/value heads (GQA)."""
    heads, kv_heads = attention_heads(model)
    for label, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count and count % tp:
            raise MpnbError(
                f"tensor_parallel={tp} does not divide the {count} {label} of {type(model).__name__} "
                f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}): every rank must hold whole "
                f"heads. Use a tensor_parallel that divides both, e.g. "
                f"{max(d for d in range(1, tp + 1) if heads % d == 0 and kv_heads % d == 0)}."
            )


def pipeline_blocks(model: Any) -> tuple[str, int] | None:
    """(dotted name, count) of the layers `config.base_model_pp_plan` names, e.g. ("model.layers", 4).

    None when the model has no pipeline plan, or its plan's layers are not a
    ModuleList on the base model.
    """
    plan = pipeline_plan(model)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not plan or base is None:
        return None
    for key in plan:
        layers = getattr(base, key, None)
        if type(layers).__name__ == "ModuleList" and len(layers):
            return f"{prefix}.{key}", len(layers)
    return None


def pipeline_problem(model: Any) -> str | None:
    """Why a transformers model cannot be cut into pipeline stages ("X has no ..."), or None."""
    name = type(model).__name__
    if pipeline_blocks(model) is None:
        return f"{name} has no pipeline plan (transformers' config.base_model_pp_plan)"
    if not hasattr(model, "lm_head"):
        return f"{name} is not a causal LM (mpnb's transformers pipeline runs *ForCausalLM models)"
    return None


def check_pipeline(model: Any, stages: int) -> tuple[str, int]:
    """The layers a transformers model's pipeline cuts; MpnbError naming the fix when it cannot be cut."""
    why = pipeline_problem(model)
    if why is not None:
        raise MpnbError(
            f"{why}, so mpnb cannot cut it into pipeline stages. Use strategy=fsdp or zero "
            "(or ddp) for it; pipeline runs Llama-family causal LMs (LlamaForCausalLM, Qwen2ForCausalLM...)."
        )
    name = type(model).__name__
    found = pipeline_blocks(model)
    assert found is not None  # pipeline_problem said so
    blocks, count = found
    if stages > count:
        raise MpnbError(
            f"pipeline_stages={stages} is more than the {count} layer{'s' * (count != 1)} of {name} "
            f"({blocks}); every stage needs at least one layer. "
            + (f"Use pipeline_stages <= {count}." if count > 1 else "Use strategy=fsdp or zero for it.")
        )
    return found
