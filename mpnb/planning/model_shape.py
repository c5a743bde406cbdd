"""What a model looks like to a parallel strategy: its repeated blocks, FSDP units, tensor plan, sizes.

The engine's strategies (which shard, split and checkpoint these modules) and
the estimator (which predicts what they will hold) read a model through the
same functions here, so the estimate follows the units the engine really
uses. Torch-free: a module is inspected by duck typing, and a torch class is
recognised by its name and module along the class's MRO, which is what
`isinstance` against the torch class answers.
"""

from __future__ import annotations

import difflib
from typing import Any

from mpnb.errors import MpnbError
from mpnb.planning.hf_plans import no_split_classes
from mpnb.planning.hf_shape import activation_shape
from mpnb.planning.parallel_dims import KNOWN_TENSOR_STYLES

_CONTAINERS = ("ModuleList", "Sequential", "ModuleDict")


def is_torch_class(obj: Any, *class_names: str) -> bool:
    """`isinstance(obj, torch.nn.<name>)` for any of `class_names`, without importing torch."""
    return any(
        cls.__name__ in class_names and cls.__module__.startswith("torch.nn.") for cls in type(obj).__mro__
    )


def is_module(obj: Any) -> bool:
    """Looks like an nn.Module (what the estimator can walk)."""
    return hasattr(obj, "named_parameters") and hasattr(obj, "named_modules") and hasattr(obj, "parameters")


def param_numel(p: Any) -> int:
    """Elements of the full parameter, also when DeepSpeed ZeRO-3 has partitioned it away."""
    return int(getattr(p, "ds_numel", 0) or p.numel())


def find_blocks(model: Any) -> tuple[str, Any] | None:
    """The model's repeated blocks: (name, container) of its largest ModuleList/Sequential of one class.

    GPT-style models keep their transformer blocks in one such container
    (`blocks`, `layers`, `h`, `transformer.h`); FSDP shards one unit per block,
    activation checkpointing wraps each block and the pipeline splitter cuts
    between blocks. The first of equally large containers wins.
    """
    best: tuple[str, Any] | None = None
    for name, module in model.named_modules():
        # ModuleDict too: a pipeline stage keeps its blocks in one, keyed by their original index
        if is_torch_class(module, *_CONTAINERS) and len(module) >= 2:
            classes = {type(m) for m in module.children()}
            if len(classes) == 1 and (best is None or len(module) > len(best[1])):
                best = (name, module)
    return best


def block_modules(model: Any) -> list[Any]:
    """The repeated blocks themselves; empty when the model has none."""
    found = find_blocks(model)
    return list(found[1].children()) if found else []


def modules_by_class(model: Any, class_names: list[str]) -> list[Any]:
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


def shard_units(model: Any, wrap_classes: list[str]) -> list[Any]:
    """The modules FSDP shards one by one (before the root).

    `wrap_classes` (config.fsdp_wrap) when given; else, for a transformers model, every module of
    the block classes its `_no_split_modules` names (what transformers itself wraps); else the
    repeated blocks.
    """
    if wrap_classes:
        return modules_by_class(model, list(wrap_classes))
    own = no_split_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in own]
    # a unit must own its parameters: one tied to a module outside it (BERT's word embeddings and
    # MLM decoder) would be resharded before the other use; outermost units only (FSDP2 nests bottom-up)
    units = [u for u in units if not _shares_parameters(model, u) and not _inside(u, units)]
    return units or block_modules(model)


def _inside(module: Any, units: list[Any]) -> bool:
    return any(u is not module and any(m is module for m in u.modules()) for u in units)


def _shares_parameters(model: Any, unit: Any) -> bool:
    """Some parameter of `unit` is also used by a module outside it (tied weights)."""
    inside = {id(p) for p in unit.parameters()}
    unit_modules = {id(m) for m in unit.modules()}
    for module in model.modules():
        if id(module) in unit_modules:
            continue
        if any(id(p) in inside for p in module.parameters(recurse=False)):
            return True
    return False


def default_tensor_plan(model: Any) -> dict[str, str]:
    """Colwise/rowwise styles for known attention and MLP layers, or Linear pairs of a Sequential."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if not is_torch_class(module, "Linear"):
            continue
        for suffix, style in KNOWN_TENSOR_STYLES.items():
            if name == suffix or name.endswith("." + suffix):
                plan[name] = style
                break
    if plan:
        return plan
    if is_torch_class(model, "Sequential"):  # Linear, act, Linear, ...: pair them colwise -> rowwise
        linears = [name for name, m in model.named_children() if is_torch_class(m, "Linear")]
        for first, second in zip(linears[0::2], linears[1::2], strict=False):
            plan[first], plan[second] = "colwise", "rowwise"
    return plan


# attention implementations that keep no s x s score tensors for backward (transformers' names)
FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def shape_from_config(model: Any) -> dict[str, Any]:
    """Layers, width, heads, sequence length, vocabulary and dropout from `model.config`, where given.

    Reads nanoGPT names (n_layer, n_embd, n_head) and the Hugging Face ones; for a transformers
    model also what its activations differ in from Korthikanti's GPT (`hf_shape.activation_shape`).
    """
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}

    def pick(*names: str) -> Any:
        for n in names:
            value = getattr(cfg, n, None)
            if value is not None:
                return value
        return None

    shape = {
        "n_layer": pick("n_layer", "num_hidden_layers", "num_layers"),
        "hidden": pick("n_embd", "hidden_size", "d_model"),
        "heads": pick("n_head", "num_attention_heads"),
        "seq_len": pick("seq_len", "block_size", "n_positions", "max_position_embeddings"),
        "vocab": pick("vocab_size"),
    }
    drop = [pick(n) for n in ("dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "hidden_dropout",
                              "attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob")]
    known = [d for d in drop if isinstance(d, (int, float))]
    if known:
        shape["dropout"] = any(d > 0 for d in known)
    attn = getattr(cfg, "_attn_implementation", None)
    # mpnb.models.GPT uses F.scaled_dot_product_attention: no a*s^2 score tensors are kept
    shape["flash"] = type(model).__module__ == "mpnb.models" or attn in FUSED_ATTENTION
    found = find_blocks(model)
    shape.update(activation_shape(model, found[0] if found else None))
    return {k: v for k, v in shape.items() if v is not None}


def even_stage_starts(units: int, stages: int) -> list[int]:
    """Index of the first of `units` blocks (or layers) on each of `stages` pipeline stages, split evenly."""
    return [i * units // stages for i in range(stages)]
