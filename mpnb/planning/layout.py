"""Where a model's parameters sit, as far as the estimator needs to know.

A `Layout` says how many parameters come before the repeated blocks
(embeddings: pipeline stage 0), in each block, and after them (final norm,
head: the last stage); how many the tensor-parallel plan splits; and the
largest FSDP unit and layer (the gathered-parameter buffers). It is read from
a module (through `model_shape`, the same functions the engine's strategies
use) or guessed from a parameter count plus a GPT shape.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

from mpnb.errors import MpnbError
from mpnb.planning.hf_plans import tensor_plan as hf_tensor_plan
from mpnb.planning.model_shape import (
    default_tensor_plan,
    even_stage_starts,
    find_blocks,
    param_numel,
    shape_from_config,
    shard_units,
)

# tensor-parallel styles (torch's and transformers') -> (splits the weight, splits the bias too);
# column styles split weight and bias by output features, row styles the weight by input features
# (their bias is added after the all-reduce, replicated), the embedding styles the table
SPLITS: dict[str, tuple[bool, bool]] = {
    **dict.fromkeys(("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise"), (True, True)),
    **dict.fromkeys(("rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise",
                     "embedding_rowwise", "embedding_colwise"), (True, False)),
}


@dataclass
class Layout:
    """Parameter counts by position in the model, plus the activation shape when known."""

    total: int
    first: int = 0  # before the blocks (embeddings): pipeline stage 0
    last: int = 0  # after the blocks (final norm, head): last pipeline stage
    blocks: list[int] = field(default_factory=list)  # parameters per repeated block
    tp_split: int | None = None  # parameters tensor parallelism splits (None: assume all of them)
    largest_layer: int = 0  # most parameters directly in one module (DeepSpeed's definition); 0 = unknown
    unit: int = 0  # parameters of the biggest FSDP unit (a block, or the model); 0 = unknown
    # activation shape (None when unknown: activations are then 0 with a note)
    n_layer: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    dropout: bool = True
    flash: bool = False
    # where a model differs from Korthikanti's GPT (`hf_shape.activation_shape`); the defaults are his
    kv_heads: int | None = None  # key/value heads (GQA); None: as many as query heads
    intermediate: int | None = None  # MLP width; None: 4 * hidden
    mlp_values: float = 2  # values of s*b*intermediate the MLP keeps
    norm_values: float = 1  # values of s*b*h each norm keeps
    embed_values: float = 0  # values of s*b*h kept before the layers (first pipeline stage)
    head_values: float = 0  # values of s*b*h kept after the layers (last stage), besides the logits
    logits: bool = True  # the head makes s*b*vocab logits (False: a pooled classifier)
    logits_fp32: bool = True  # the loss keeps an fp32 log-softmax (else one in the compute precision)
    fp32_values: float = 0  # of each layer's values, those fp32 in any precision (RMSNorm's x.float())
    head_fp32_values: float = 0  # the same after the layers
    # under torch autocast (16-bit compute, fp32 residual stream): fp32 values per layer, before and after
    # the layers, and the extra 16-bit copies of a layer's inputs (`hf_shape`)
    autocast_fp32_values: float = 0
    autocast_outside_fp32: tuple[float, float] = (0, 0)
    input_copies: float = 0
    arch: str = ""  # what the model is, for the formula's description

    def stage_params(self, stages: int, stage: int) -> int:
        """Parameters of pipeline stage `stage` (the whole model for one stage)."""
        if stages == 1:
            return self.total
        if not self.blocks:
            return math.ceil(self.total / stages)
        starts = [*even_stage_starts(len(self.blocks), stages), len(self.blocks)]
        params = sum(self.blocks[starts[stage] : starts[stage + 1]])
        if stage == 0:
            params += self.first
        if stage == stages - 1:
            params += self.last
        return params


def layout_from_count(n: int, shape: dict[str, Any], plan_is_default: bool) -> Layout:
    """A GPT-like layout for `n` parameters when `shape` gives n_layer and hidden, else one lump."""
    layout = Layout(total=n, largest_layer=shape.get("largest_layer") or 0)
    L, h = shape.get("n_layer"), shape.get("hidden")
    if L and h:
        per_block = 12 * h * h + 13 * h  # qkv, proj, fc, proj weights + biases, two layer norms
        vocab = shape.get("vocab") or 0
        if per_block * L <= n:
            layout.blocks = [per_block] * L
            if plan_is_default:  # qkv, proj, fc, proj weights and the column-parallel biases
                layout.tp_split = (12 * h * h + 7 * h) * L
            rest = n - per_block * L
            head = min(rest, vocab * h + 2 * h) if vocab else 0
            layout.last, layout.first = head, rest - head
        if not layout.largest_layer:
            layout.largest_layer = max(4 * h * h + 4 * h, vocab * h)
    if not layout.blocks:
        layout.first = n
    layout.unit = max(layout.blocks) if layout.blocks else 0  # a bare count says nothing of its layers
    return layout


def layout_from_module(
    model: Any, plan: dict[str, str], wrap_classes: list[str]
) -> tuple[Layout, dict[str, Any]]:
    """The layout of `model` and its shape from `model.config` (see `model_shape.shape_from_config`).

    A parameter shared by several modules (tied input and output embeddings) counts once in
    `total`, and once in each of first / blocks / last whose modules use it: a pipeline puts the
    embedding on the first stage and the LM head on the last, and both stages hold the weight.
    """
    total = sum(param_numel(p) for p in {id(p): p for p in model.parameters()}.values())
    largest = 0
    for _, m in model.named_modules():
        largest = max(largest, sum(param_numel(p) for p in m.parameters(recurse=False)))
    layout = Layout(total=total, largest_layer=largest)
    layout.tp_split = tensor_split_params(model, plan)
    found = find_blocks(model)
    if found:
        name, container = found
        block_ids: set[int] = set()
        for block in container.children():
            own = [p for p in block.parameters() if id(p) not in block_ids]
            block_ids.update(id(p) for p in own)
            layout.blocks.append(sum(param_numel(p) for p in own))
        seen: dict[str, set[int]] = {"first": set(), "last": set()}
        where = "first"
        for module_name, module in model.named_modules():
            if module_name == name or module_name.startswith(name + "."):
                where = "last"
                continue
            for p in module.parameters(recurse=False):
                if id(p) not in block_ids and id(p) not in seen[where]:
                    seen[where].add(id(p))
                    setattr(layout, where, getattr(layout, where) + param_numel(p))
    else:
        layout.first = total
    # FSDP shards these units one by one (the engine's own choice), else the model is the unit
    try:
        units = shard_units(model, list(wrap_classes))
    except MpnbError:  # fsdp_wrap names classes the model lacks: the engine refuses it, ignore it here
        units = []
    layout.unit = max(_unit_sizes(units) or layout.blocks or [total])
    return layout, shape_from_config(model)


def _unit_sizes(units: list[Any]) -> list[int]:
    """Parameters each FSDP unit gathers: its own, less those of units nested inside it."""
    claimed: set[int] = set()
    sizes = []
    for unit in reversed(units):  # modules() lists a unit before the units inside it
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(sum(param_numel(p) for p in own))
    return sizes


def tensor_split_params(model: Any, plan: dict[str, str]) -> int:
    """Parameters the tensor-parallel plan splits (`SPLITS`: which of weight and bias each style splits).

    `plan` maps module-path patterns (fnmatch, as `config.tensor_plan`) to styles; empty means
    the model's own: a transformers model's `base_model_tp_plan` (resolved with its head's entries,
    `hf_plans.tensor_plan`), else the engine's default plan (`model_shape.default_tensor_plan`).
    A parameter shared by two planned modules (tied embeddings) is split once.
    """
    modules = dict((name, m) for name, m in model.named_modules() if name)
    plan = plan or hf_tensor_plan(model) or {}
    styles: dict[str, str] = {}
    if plan:
        for name in modules:
            for pattern, style in plan.items():
                if fnmatch.fnmatchcase(name, pattern):
                    styles[name] = style
    else:
        styles = {name: style for name, style in default_tensor_plan(model).items() if name in modules}
    split: dict[int, int] = {}
    for name, style in styles.items():
        weight, bias = SPLITS.get(style, (False, False))
        for pname, p in modules[name].named_parameters(recurse=False):
            if weight if pname == "weight" else bias:
                split[id(p)] = param_numel(p)
    return sum(split.values())
