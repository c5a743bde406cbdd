"""`mpnb.estimate`: what each rank will hold, before anything runs.

Model states (parameters, gradients, optimizer state) follow the ZeRO paper
(Rajbhandari et al. 2020): with Ψ parameters and N data-parallel ranks, a rank
holds P·Ψ + G·Ψ + K·Ψ bytes under DDP / ZeRO-0, (P + G)·Ψ + K·Ψ/N under
ZeRO-1, P·Ψ + (G + K)·Ψ/N under ZeRO-2 and (P + G + K)·Ψ/N under ZeRO-3 and
FSDP. P, G and K are what each implementation really keeps
(`MODEL_STATE_BYTES`, the one table the strategies' `memory_breakdown()` is
checked against):

=================================  =====  ===  ===========================
strategy, precision                P      G    K (master + optimizer)
=================================  =====  ===  ===========================
ddp, fsdp, pipeline, tensor; any   4      4    0 + 8 (AdamW moments, fp32)
zero 1-3, fp32                     4      4    4 + 8 (fp32 master clone)
zero 1-3, bf16 / fp16 (paper)      2      2    4 + 8
zero 0, fp32 (torch optimizer)     4      4    0 + 8
zero 0, bf16 / fp16                2      2    4 + 8 (unpartitioned)
=================================  =====  ===  ===========================

torch keeps fp32 parameters and gradients under bf16/fp16 (autocast, or FSDP2's
MixedPrecisionPolicy whose bf16 copy is transient), so only activations shrink.
Optimizer moments per parameter: AdamW 8, SGD with momentum 4, SGD 0.
`accounting="paper"` uses 2 + 2 + 12 for every strategy (the paper's Figure 1);
`accounting="deepspeed"` reproduces DeepSpeed's own
`estimate_zero2/3_model_states_mem_needs` (2 + 6 + 12 at stage 2, 2 + 4 + 12
plus 4 bytes per parameter of the largest layer at stage 3).

Model parallelism splits the model before data parallelism divides it:
pipeline stages hold their own blocks (stage 0 the embeddings, the last stage
the head), sharded by FSDP2 over data-parallel ranks; tensor parallelism divides the
matrices named by the plan (column: weight and bias; row: weight) by the degree,
then FSDP2 shards the result over the data-parallel ranks.

Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity, FSDP2 CPUOffloadPolicy) moves
the optimizer state (and at ZeRO-2/3 the gradient partition), or at
offload=parameters all model states, to CPU memory: counted in `offloaded`.

Activations use Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"): per transformer layer, in 16-bit,
s·b·h·(34 + 5·a·s/h) bytes, of which 32·sbh are 2-byte tensors (16 values of
s·b·h), 2·sbh one-byte dropout masks, and 5·a·s²·b the attention scores
(2 + 2 bytes softmax and dropout output, 1 byte mask). In fp32 the 2-byte
tensors double and the masks do not: s·b·h·(66 + 9·a·s/h). Without dropout the
masks and the dropout output go; with fused attention (flash / SDPA) the
a·s² terms go. Tensor parallelism without sequence parallelism divides 12 of
the 16 values and the scores by t: s·b·h·(10 + 24/t + 5·a·s/(h·t)) in 16-bit.
Full activation checkpointing keeps each layer's input (s·b·h values) plus one
layer's full activations while it is recomputed. Pipelines keep several
microbatches in flight: GPipe all m, 1F1B at most pp - stage on stage `stage`.
The last stage also holds the fp32 log-softmax of the logits (4·s·b·V).

Buffers (reported separately, as `memory_breakdown()` does) are the gathered
parameters of FSDP2 / ZeRO-3 (current and prefetched unit), DeepSpeed's
gradient reduction bucket at ZeRO-1/2 (`reduce_bucket_size` elements, 5e8 by
default, allocated whole) and DDP's buckets (none: mpnb uses gradient views).

Bytes are plain ints; "GB" in text means 10^9 bytes, as in the ZeRO paper.
This module does not import torch: a module passed in is inspected by duck
typing, and a plain parameter count needs nothing else.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.codegen import KNOWN_TENSOR_STYLES
from mpnb.planning.config import Config

# (implementation, precision) -> (P, G, master) bytes per parameter; optimizer moments come on top.
MODEL_STATE_BYTES: dict[tuple[str, str], tuple[int, int, int]] = {
    ("torch", "fp32"): (4, 4, 0),
    ("torch", "bf16"): (4, 4, 0),
    ("torch", "fp16"): (4, 4, 0),
    ("zero", "fp32"): (4, 4, 4),
    ("zero", "bf16"): (2, 2, 4),
    ("zero", "fp16"): (2, 2, 4),
    ("zero0", "fp32"): (4, 4, 0),
    ("zero0", "bf16"): (2, 2, 4),
    ("zero0", "fp16"): (2, 2, 4),
}
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}
ACCOUNTINGS = ("implementation", "paper", "deepspeed")
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)


# ---------------------------------------------------------------------- results


@dataclass(frozen=True)
class RankEstimate:
    """Bytes one rank holds on its device, by category, plus what it keeps in CPU memory."""

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    offloaded: int = 0

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers


@dataclass(frozen=True)
class Estimate:
    """Per-rank prediction; the category attributes are those of the most loaded rank."""

    ranks: tuple[RankEstimate, ...]
    num_params: int
    summary: str
    bytes_per_param: tuple[float, float, float]  # P, G, K as used
    notes: tuple[str, ...] = field(default=())

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def parameters(self) -> int:
        return self.worst.parameters

    @property
    def gradients(self) -> int:
        return self.worst.gradients

    @property
    def optimizer(self) -> int:
        return self.worst.optimizer

    @property
    def activations(self) -> int:
        return self.worst.activations

    @property
    def buffers(self) -> int:
        return self.worst.buffers

    @property
    def offloaded(self) -> int:
        return self.worst.offloaded

    @property
    def model_states(self) -> int:
        return self.worst.model_states

    @property
    def total(self) -> int:
        return self.worst.total

    def by_rank(self) -> dict[int, int]:
        """{rank: total device bytes}, the shape `MemoryStore.estimate` takes."""
        return {r.rank: r.total for r in self.ranks}

    def fits(self, capacity: int) -> bool:
        return all(r.total <= capacity for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "parameters": worst.parameters,
            "gradients": worst.gradients,
            "optimizer": worst.optimizer,
            "activations": worst.activations,
            "buffers": worst.buffers,
            "offloaded": worst.offloaded,
            "model_states": worst.model_states,
            "total": worst.total,
            "num_params": self.num_params,
            "summary": self.summary,
            "bytes_per_param": list(self.bytes_per_param),
            "per_rank": [{**asdict(r), "total": r.total} for r in self.ranks],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        w = self.worst
        same = all(r.total == w.total for r in self.ranks)
        who = "every rank" if same else f"rank {w.rank} (most loaded)"
        parts = [
            f"parameters {format_bytes(w.parameters)}",
            f"gradients {format_bytes(w.gradients)}",
            f"optimizer {format_bytes(w.optimizer)}",
            f"activations {format_bytes(w.activations)}",
            f"buffers {format_bytes(w.buffers)}",
        ]
        if w.offloaded:
            parts.append(f"offloaded to CPU {format_bytes(w.offloaded)}")
        return (
            f"<Estimate {self.summary}, {self.num_params:,} params: {who} holds "
            f"{format_bytes(w.total)} = {', '.join(parts)}>"
        )


def format_bytes(n: float) -> str:
    """1.9 GB, 31.4 GB, 512.0 MB, 12.0 KB (decimal units, as in the ZeRO paper)."""
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------- model description


@dataclass
class _Layout:
    """Where the parameters sit, as far as the estimate needs to know."""

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


def _layout_from_count(n: int, shape: dict[str, Any], plan_is_default: bool) -> _Layout:
    layout = _Layout(total=n, largest_layer=shape.get("largest_layer") or 0)
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


def _numel(p: Any) -> int:
    """Elements of the full parameter, also when DeepSpeed ZeRO-3 has partitioned it away."""
    return int(getattr(p, "ds_numel", 0) or p.numel())


def _is_module(obj: Any) -> bool:
    return hasattr(obj, "named_parameters") and hasattr(obj, "named_modules") and hasattr(obj, "parameters")


def _find_blocks(model: Any) -> tuple[str, list[Any]]:
    """The repeated blocks: `model.blocks`, else the largest ModuleList-like container of 2+ modules."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None and hasattr(blocks, "__len__") and len(blocks) > 0:
        name = next((n for n, m in model.named_modules() if m is blocks), "blocks")
        return name, list(blocks.values() if hasattr(blocks, "values") else blocks)
    best: tuple[str, list[Any]] = ("", [])
    for name, module in model.named_modules():
        if type(module).__name__ in ("ModuleList", "Sequential") and name:
            children = list(module.children())
            kinds = {type(c).__name__ for c in children}
            if len(children) >= 2 and len(kinds) == 1 and len(children) > len(best[1]):
                best = (name, children)
    return best


def _shape_from_config(model: Any) -> dict[str, Any]:
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
    drop = [pick(n) for n in ("dropout", "resid_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout")]
    known = [d for d in drop if isinstance(d, (int, float))]
    if known:
        shape["dropout"] = any(d > 0 for d in known)
    attn = getattr(cfg, "_attn_implementation", None)
    # mpnb.models.GPT uses F.scaled_dot_product_attention: no a*s^2 score tensors are kept
    shape["flash"] = type(model).__module__ == "mpnb.models" or attn in ("sdpa", "flash_attention_2")
    return {k: v for k, v in shape.items() if v is not None}


def _tensor_split_params(model: Any, plan: dict[str, str]) -> int:
    """Parameters the tensor-parallel plan splits: colwise Linear weight and bias, rowwise weight.

    `plan` maps module-path patterns (fnmatch, as `config.tensor_plan`) to styles;
    empty means the default plan: Linear layers whose names end in a known suffix,
    else the Linear pairs of an nn.Sequential.
    """
    modules = [(name, m) for name, m in model.named_modules() if name]
    styles: dict[str, str] = {}
    if plan:
        for name, _ in modules:
            for pattern, style in plan.items():
                if fnmatch.fnmatchcase(name, pattern):
                    styles[name] = style
    else:
        for name, m in modules:
            if type(m).__name__ != "Linear":
                continue
            for suffix, style in KNOWN_TENSOR_STYLES.items():
                if name == suffix or name.endswith("." + suffix):
                    styles[name] = style
                    break
        if not styles and type(model).__name__ == "Sequential":
            linears = [n for n, m in model.named_children() if type(m).__name__ == "Linear"]
            for first, second in zip(linears[0::2], linears[1::2], strict=False):
                styles[first], styles[second] = "colwise", "rowwise"
    total = 0
    by_name = dict(modules)
    for name, style in styles.items():
        module = by_name[name]
        for pname, p in module.named_parameters(recurse=False):
            if pname == "weight" or (style == "colwise" and type(module).__name__ == "Linear"):
                total += _numel(p)
    return total


def _layout_from_module(model: Any, plan: dict[str, str]) -> tuple[_Layout, dict[str, Any]]:
    seen: dict[int, int] = {}
    order: list[tuple[str, int, int]] = []  # (name, key, numel)
    for name, p in model.named_parameters(remove_duplicate=True):
        key = id(p)
        if key not in seen:
            seen[key] = _numel(p)
            order.append((name, key, _numel(p)))
    total = sum(seen.values())
    largest = 0
    for _, m in model.named_modules():
        largest = max(largest, sum(_numel(p) for p in m.parameters(recurse=False)))
    layout = _Layout(total=total, largest_layer=largest)

    layout.tp_split = _tensor_split_params(model, plan)
    _, blocks = _find_blocks(model)
    if blocks:
        block_keys: set[int] = set()
        for block in blocks:
            count = 0
            for p in block.parameters():
                if id(p) not in block_keys:
                    block_keys.add(id(p))
                    count += _numel(p)
            layout.blocks.append(count)
        seen_block = False
        for _name, key, numel in order:
            if key in block_keys:
                seen_block = True
            elif not seen_block:
                layout.first += numel
            else:
                layout.last += numel
    else:
        layout.first = total
    # FSDP shards each block as a unit, else the whole model is the one unit
    layout.unit = max(layout.blocks) if layout.blocks else total
    return layout, _shape_from_config(model)


# ---------------------------------------------------------------------- the estimate


def estimate(
    model_or_num_params: Any,
    config: Config | dict[str, Any] | None = None,
    world_size: int = 1,
    *,
    seq_len: int | None = None,
    micro_batch_size: int | None = None,
    n_layer: int | None = None,
    hidden: int | None = None,
    n_head: int | None = None,
    vocab_size: int | None = None,
    largest_layer_params: int | None = None,
    optimizer: str = "adamw",
    accounting: str = "implementation",
    bytes_per_param: tuple[float, float, float] | None = None,
    dropout: bool | None = None,
    flash_attention: bool | None = None,
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET,
) -> Estimate:
    """Predict the bytes each of `world_size` ranks holds under `config`.

    `model_or_num_params` is an nn.Module (parameters counted, shape read from
    `model.config` with n_layer/n_embd/n_head or the Hugging Face names) or a
    parameter count; then pass `n_layer`, `hidden`, `n_head` (and `vocab_size`)
    to get activations. `micro_batch_size` defaults to the config's.
    `bytes_per_param=(P, G, K)` overrides the table for a custom optimizer setup.
    """
    cfg = _as_config(config)
    if accounting not in ACCOUNTINGS:
        raise ConfigError(f"accounting must be one of {', '.join(ACCOUNTINGS)} (got {accounting!r}).")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)} (got {optimizer!r}); "
            "or pass bytes_per_param=(P, G, K)."
        )
    problems = cfg.problems(world_size, None)
    if problems:
        raise ConfigError(problems[0])
    plan = dict(cfg.tensor_plan)  # empty: the default plan (KNOWN_TENSOR_STYLES)

    if isinstance(model_or_num_params, bool) or not (
        isinstance(model_or_num_params, int) or _is_module(model_or_num_params)
    ):
        raise ConfigError(
            "estimate() takes an nn.Module or a parameter count (int), "
            f"got {type(model_or_num_params).__name__}."
        )
    given = {
        "n_layer": n_layer,
        "hidden": hidden,
        "heads": n_head,
        "seq_len": seq_len,
        "vocab": vocab_size,
        "largest_layer": largest_layer_params,
    }
    if isinstance(model_or_num_params, int):
        if model_or_num_params < 0:
            raise ConfigError(f"The parameter count must be positive (got {model_or_num_params}).")
        shape = {k: v for k, v in given.items() if v is not None}
        layout = _layout_from_count(model_or_num_params, shape, plan_is_default=not cfg.tensor_plan)
    else:
        layout, shape = _layout_from_module(model_or_num_params, plan)
        shape.update({k: v for k, v in given.items() if v is not None})
        if largest_layer_params:
            layout.largest_layer = largest_layer_params
    layout.n_layer = shape.get("n_layer")
    layout.hidden = shape.get("hidden")
    layout.heads = shape.get("heads")
    layout.seq_len = shape.get("seq_len")
    layout.vocab = shape.get("vocab")
    layout.dropout = dropout if dropout is not None else shape.get("dropout", True)
    layout.flash = flash_attention if flash_attention is not None else shape.get("flash", False)

    ppk = _bytes_per_param(cfg, optimizer, accounting, bytes_per_param)
    mb = micro_batch_size if micro_batch_size is not None else cfg.micro_batch_size
    notes: list[str] = []
    if layout.n_layer is None or layout.hidden is None or layout.seq_len is None:
        notes.append(
            "activations not estimated: pass n_layer, hidden, n_head and seq_len (or a model "
            "with a config) to include them"
        )
    gathers = cfg.strategy in ("zero", "fsdp") or cfg.data_parallel(world_size) > 1
    if _zero_stage(cfg) == 3 and gathers and accounting == "implementation" and not (
            layout.unit if cfg.strategy != "zero" else layout.largest_layer):
        notes.append("the gathered-parameter buffers of ZeRO-3/FSDP are not estimated: pass "
                     "largest_layer_params, or n_layer and hidden, or the model itself")
    if cfg.strategy == "tensor" and layout.tp_split == 0:
        notes.append("no parameters matched the tensor-parallel plan; parameters are counted unsplit")
    ranks = tuple(
        _rank_estimate(r, cfg, world_size, layout, ppk, mb, accounting, reduce_bucket_size)
        for r in range(world_size)
    )
    worst = max(ranks, key=lambda r: r.total)
    if (
        cfg.strategy == "zero"
        and cfg.zero_stage in (1, 2)
        and accounting == "implementation"
        and (worst.buffers > worst.model_states)
    ):
        notes.append(
            f"DeepSpeed's gradient reduction bucket ({reduce_bucket_size:.2g} elements, allocated "
            "whole) outweighs the model states here; a smaller reduce_bucket_size saves it"
        )
    return Estimate(
        ranks=ranks,
        num_params=layout.total,
        summary=cfg.summary(world_size),
        bytes_per_param=ppk,
        notes=tuple(notes),
    )


def _as_config(config: Config | dict[str, Any] | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config().update(**config)
    raise ConfigError(f"config must be an mpnb.Config or a dict, got {type(config).__name__}.")


def _bytes_per_param(
    cfg: Config, optimizer: str, accounting: str, override: tuple[float, float, float] | None
) -> tuple[float, float, float]:
    """(P, G, K) for this strategy and precision: the table in the module docstring."""
    if override is not None:
        p, g, k = override
        return float(p), float(g), float(k)
    moments = OPTIMIZER_STATE_BYTES[optimizer]
    if accounting == "paper":
        return 2.0, 2.0, 4.0 + moments
    if accounting == "deepspeed":
        # DeepSpeed's estimators: 16-bit params; stage 2 adds 16- and 32-bit grads, stage 3 32-bit grads
        return 2.0, (4.0 if _zero_stage(cfg) == 3 else 6.0), 4.0 + moments
    family = "torch"
    if cfg.strategy == "zero":
        family = "zero0" if cfg.zero_stage == 0 else "zero"
    p, g, master = MODEL_STATE_BYTES[(family, cfg.precision)]
    return float(p), float(g), float(master + moments)


def _zero_stage(cfg: Config) -> int:
    """The ZeRO stage that describes how the data-parallel ranks share model states."""
    if cfg.strategy == "zero":
        return cfg.zero_stage
    if cfg.strategy in ("fsdp", "tensor", "pipeline"):
        # FSDP2 shards parameters, gradients and optimizer state; tensor and pipeline compose with it
        # over their data-parallel ranks (with dp = 1 nothing is shared, so this changes nothing)
        return 3
    return 0  # ddp


def _stage_params(layout: _Layout, stages: int, stage: int) -> int:
    """Parameters of pipeline stage `stage` (the whole model for one stage)."""
    if stages == 1:
        return layout.total
    if not layout.blocks:
        return math.ceil(layout.total / stages)
    per = len(layout.blocks) / stages
    lo, hi = round(stage * per), round((stage + 1) * per)
    params = sum(layout.blocks[lo:hi])
    if stage == 0:
        params += layout.first
    if stage == stages - 1:
        params += layout.last
    return params


def _rank_estimate(
    rank: int,
    cfg: Config,
    world: int,
    layout: _Layout,
    ppk: tuple[float, float, float],
    mb: int,
    accounting: str,
    bucket: int,
) -> RankEstimate:
    P, G, K = ppk
    pp, tp = cfg.pipeline_stages, cfg.tensor_parallel
    dp = cfg.data_parallel(world)
    # pipeline outermost in the engine's (pp, dp) mesh: ranks [s*dp, (s+1)*dp) hold stage s
    stage = rank // dp if cfg.strategy == "pipeline" else 0

    local = _stage_params(layout, pp, stage)
    if cfg.strategy == "tensor" and tp > 1:  # pipeline and tensor do not compose: local is the model
        split = layout.tp_split if layout.tp_split is not None else local
        local = local - split + math.ceil(split / tp)

    zs = _zero_stage(cfg)
    shards = {  # how many ranks share each category (1 = replicated)
        0: (1, 1, 1),
        1: (1, 1, dp),
        2: (1, dp, dp),
        3: (dp, dp, dp),
    }[zs]
    params = int(local * P / shards[0])
    grads = int(local * G / shards[1])
    optim = int(local * K / shards[2])

    offloaded = 0
    if cfg.offload == "parameters":
        offloaded, params, grads, optim = params + grads + optim, 0, 0, 0
    elif cfg.offload == "optimizer":
        offloaded, optim = optim, 0
        if zs >= 2:  # ZeRO-Offload reduces the gradient partition straight to CPU memory
            offloaded, grads = offloaded + grads, 0

    buffers = _buffers(cfg, layout, local, zs, dp, accounting, bucket)
    acts = _activations(cfg, layout, mb, stage)
    return RankEstimate(
        rank=rank,
        parameters=params,
        gradients=grads,
        optimizer=optim,
        activations=acts,
        buffers=buffers,
        offloaded=offloaded,
    )


def _buffers(cfg: Config, layout: _Layout, local: int, zs: int, dp: int, accounting: str, bucket: int) -> int:
    compute = COMPUTE_BYTES[cfg.precision]
    if accounting == "deepspeed":
        # DeepSpeed's estimator: 4 bytes per parameter of the largest layer at stage 3, nothing at stage 2
        return 4 * layout.largest_layer if zs == 3 else 0  # 0 when the largest layer is unknown
    if cfg.strategy == "zero":
        if cfg.zero_stage in (1, 2):
            # the gradient reduction bucket, allocated whole in the gradient dtype
            return bucket * compute
        if cfg.zero_stage == 3:
            return 4 * layout.largest_layer  # gathered 16-bit parameters and gradients of one layer
        return 0
    if (zs == 3 and dp > 1) or cfg.strategy == "fsdp":  # FSDP2 (alone, or under tensor parallelism)
        unit = layout.unit
        if not cfg.reshard_after_forward:
            return int(local * compute)  # gathered parameters stay from forward to backward
        # current and prefetched unit in compute precision, plus one unit's unsharded fp32 gradient
        return int(2 * unit * compute + 4 * unit)
    return 0  # DDP with gradient_as_bucket_view: gradients live in the buckets


def _activations(cfg: Config, layout: _Layout, mb: int, stage: int) -> int:
    if layout.n_layer is None or layout.hidden is None or layout.seq_len is None:
        return 0
    s, h = layout.seq_len, layout.hidden
    a = layout.heads or 1
    pp, tp = cfg.pipeline_stages, cfg.tensor_parallel
    t = tp if cfg.strategy == "tensor" else 1
    nbytes = COMPUTE_BYTES[cfg.precision]

    if cfg.strategy == "pipeline":
        b = mb // cfg.microbatches
        per = layout.n_layer / pp
        layers = round((stage + 1) * per) - round(stage * per)
        gpipe = cfg.pipeline_schedule == "gpipe"
        in_flight = cfg.microbatches if gpipe else min(pp - stage, cfg.microbatches)
        last = stage == pp - 1
    else:
        b, layers, in_flight, last = mb, layout.n_layer, 1, True

    sbh = s * b * h
    scores = 0 if layout.flash else a * s * s * b
    # 16 values of s*b*h per layer: 4 replicated (layer norm inputs, attention and MLP inputs), 12 split by t
    values = nbytes * (4 * sbh + 12 * sbh / t)
    score_values = (2 if layout.dropout else 1) * nbytes * scores / t
    masks = (2 * sbh + scores / t) if layout.dropout else 0
    full_layer = values + score_values + masks
    if cfg.activation_checkpointing:
        per_microbatch = layers * nbytes * sbh + full_layer  # layer inputs + the layer being recomputed
    else:
        per_microbatch = layers * full_layer
    total = per_microbatch * in_flight
    if last and layout.vocab:
        total += 4 * s * b * layout.vocab * in_flight  # fp32 log-softmax of the logits for the loss
    return int(total)
