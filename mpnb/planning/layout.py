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

from mpnb.planning.model_shape import (
    block_modules,
    default_tensor_plan,
    even_stage_starts,
    is_torch_class,
    param_numel,
    shape_from_config,
)


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
    """The layout of `model` and its shape from `model.config` (see `model_shape.shape_from_config`)."""
    seen: dict[int, int] = {}
    order: list[tuple[int, int]] = []  # (id, numel) in registration order
    for _, p in model.named_parameters(remove_duplicate=True):
        if id(p) not in seen:
            seen[id(p)] = param_numel(p)
            order.append((id(p), param_numel(p)))
    total = sum(seen.values())
    largest = 0
    for _, m in model.named_modules():
        largest = max(largest, sum(param_numel(p) for p in m.parameters(recurse=False)))
    layout = Layout(total=total, largest_layer=largest)

    layout.tp_split = tensor_split_params(model, plan)
    blocks = block_modules(model)
    if blocks:
        block_keys: set[int] = set()
        for block in blocks:
            count = 0
            for p in block.parameters():
                if id(p) not in block_keys:
                    block_keys.add(id(p))
                    count += param_numel(p)
            layout.blocks.append(count)
        seen_block = False
        for key, numel in order:
            if key in block_keys:
                seen_block = True
            elif not seen_block:
                layout.first += numel
            else:
                layout.last += numel
    else:
        layout.first = total
    # FSDP shards the fsdp_wrap classes, else each block, as a unit; without either the model is the unit
    wrapped = _unit_sizes([m for m in model.modules() if type(m).__name__ in wrap_classes])
    layout.unit = max(wrapped or layout.blocks or [total])
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
    """Parameters the tensor-parallel plan splits: colwise Linear weight and bias, rowwise weight.

    `plan` maps module-path patterns (fnmatch, as `config.tensor_plan`) to styles;
    empty means the engine's default plan (`model_shape.default_tensor_plan`).
    """
    modules = dict((name, m) for name, m in model.named_modules() if name)
    styles: dict[str, str] = {}
    if plan:
        for name in modules:
            for pattern, style in plan.items():
                if fnmatch.fnmatchcase(name, pattern):
                    styles[name] = style
    else:
        styles = {name: style for name, style in default_tensor_plan(model).items() if name in modules}
    total = 0
    for name, style in styles.items():
        module = modules[name]
        for pname, p in module.named_parameters(recurse=False):
            if pname == "weight" or (style == "colwise" and is_torch_class(module, "Linear")):
                total += param_numel(p)
    return total
