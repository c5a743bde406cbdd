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
then FSDP2 shards the result over the data-parallel ranks. A transformers model
brings its own plan (`hf_plans.tensor_plan`: embeddings and LM head split too);
a tied embedding / head weight counts once, except on pipeline stages, where the
first stage's embedding and the last stage's head each hold it.

Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity, FSDP2 CPUOffloadPolicy) moves
the optimizer state (and at ZeRO-2/3 the gradient partition), or at
offload=parameters all model states, to CPU memory: counted in `offloaded` (by
category in `offloaded_parts`; `RankEstimate.held()` adds them back, as
`memory_breakdown()` counts a rank's tensors wherever they sit).

Activations follow Korthikanti et al. 2022 (`mpnb.planning.activations`), adapted to
what a transformers config says (GQA, MLP width and kind, RMSNorm: `hf_shape`), and
`Estimate.activation_formula` says which formula was used; where the
parameters sit (embeddings, blocks, head, what the tensor plan splits) is a
`mpnb.planning.layout.Layout`.

Buffers (reported separately, as `memory_breakdown()` does) are the gathered
parameters of FSDP2 / ZeRO-3 (current and prefetched unit), DeepSpeed's
gradient reduction bucket (`reduce_bucket_size` elements, 5e8 by default,
allocated whole: during backward at ZeRO-1/2, from initialize on at ZeRO-3)
and DDP's buckets (none: mpnb uses gradient views).

Bytes are plain ints; text shows them in GiB/MiB (`mpnb.units`). The ZeRO paper
writes decimal GB (10^9 bytes): divide by 1e9 to compare with it.
This module does not import torch: a module passed in is inspected by duck
typing, and a plain parameter count needs nothing else.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.activations import (
    AUTOCAST_NOTE,
    COMPUTE_BYTES,
    activation_bytes,
    describe_formula,
    uses_autocast,
)
from mpnb.planning.comm_estimate import comm_bytes_per_step
from mpnb.planning.config import Config
from mpnb.planning.config_values import read_int, shown
from mpnb.planning.estimate_result import Estimate, RankEstimate
from mpnb.planning.layout import Layout, layout_from_count, layout_from_module
from mpnb.planning.model_shape import is_module
from mpnb.planning.parallel_dims import ParallelDims, Strategy

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
# shape keys where a transformers model departs from Korthikanti's GPT (`hf_shape.activation_shape`)
SHAPE_EXTRAS = ("kv_heads", "intermediate", "mlp_values", "norm_values", "embed_values", "head_values",
                "logits", "logits_fp32", "fp32_values", "head_fp32_values", "autocast_fp32_values",
                "autocast_outside_fp32", "input_copies", "arch")
DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)


def reduce_bucket_elements(num_params: int) -> int:
    """The reduce bucket mpnb gives DeepSpeed: its default, but never larger than the model."""
    return max(1, min(DEFAULT_REDUCE_BUCKET, num_params))
MAX_COUNT = 2**63 - 1  # parameters, elements: what torch's int64 sizes can count
MAX_RANKS = 2**20  # the estimate has one row per rank


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
    reduce_bucket_size: int | None = None,
) -> Estimate:
    """Predict the bytes each of `world_size` ranks holds under `config`.

    `model_or_num_params` is an nn.Module (parameters counted, shape read from
    `model.config` with n_layer/n_embd/n_head or the Hugging Face names) or a
    parameter count; then pass `n_layer`, `hidden`, `n_head` (and `vocab_size`)
    to get activations. `micro_batch_size` defaults to the config's.
    `bytes_per_param=(P, G, K)` overrides the table for a custom optimizer setup.
    `reduce_bucket_size` defaults to what mpnb gives DeepSpeed (`reduce_bucket_elements`).
    """
    cfg = _as_config(config)
    world_size = read_int("world_size", world_size, maximum=MAX_RANKS)
    seq_len, micro_batch_size, n_layer, hidden, n_head, vocab_size, largest_layer_params = (
        _size(name, value) for name, value in (
            ("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("n_layer", n_layer),
            ("hidden", hidden), ("n_head", n_head), ("vocab_size", vocab_size),
            ("largest_layer_params", largest_layer_params)))
    if reduce_bucket_size is not None:
        reduce_bucket_size = read_int("reduce_bucket_size", reduce_bucket_size, maximum=MAX_COUNT)
    for name, flag in (("dropout", dropout), ("flash_attention", flash_attention)):
        if flag is not None and not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True, False or None (got {shown(flag)}).")
    if accounting not in ACCOUNTINGS:
        raise ConfigError(f"accounting must be one of {', '.join(ACCOUNTINGS)} (got {accounting!r}).")
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(
            f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)} (got {optimizer!r}); "
            "or pass bytes_per_param=(P, G, K)."
        )
    problems = cfg.problems(world_size, None)
    if problems:
        raise ConfigError(problems[0])
    dims = ParallelDims.from_config(cfg, world_size)
    plan = dict(cfg.tensor_plan)  # empty: the engine's default plan

    if not is_module(model_or_num_params):
        model_or_num_params = _parameter_count(model_or_num_params)
    given = {
        "n_layer": n_layer,
        "hidden": hidden,
        "heads": n_head,
        "seq_len": seq_len,
        "vocab": vocab_size,
        "largest_layer": largest_layer_params,
    }
    if isinstance(model_or_num_params, int):
        shape = {k: v for k, v in given.items() if v is not None}
        layout = layout_from_count(model_or_num_params, shape, plan_is_default=not cfg.tensor_plan)
    else:
        layout, shape = layout_from_module(model_or_num_params, plan, list(cfg.fsdp_wrap))
        shape.update({k: v for k, v in given.items() if v is not None})
        if largest_layer_params:
            layout.largest_layer = largest_layer_params
    for key in ("n_layer", "hidden", "heads", "seq_len", "vocab"):
        setattr(layout, key, shape.get(key))
    for key in SHAPE_EXTRAS:  # a transformers model's departures from Korthikanti's GPT
        if key in shape:
            setattr(layout, key, shape[key])
    layout.dropout = dropout if dropout is not None else shape.get("dropout", True)
    layout.flash = flash_attention if flash_attention is not None else shape.get("flash", False)

    ppk = _bytes_per_param(cfg, optimizer, accounting, bytes_per_param)
    mb = micro_batch_size if micro_batch_size is not None else cfg.micro_batch_size
    notes: list[str] = []
    formula = describe_formula(cfg, layout, mb)
    if formula:
        notes.append(f"activations: {formula}")
        if cfg.precision != "fp32" and uses_autocast(cfg, dims):
            notes.append(AUTOCAST_NOTE)
    else:
        notes.append(
            "activations not estimated: pass n_layer, hidden, n_head and seq_len (or a model "
            "with a config) to include them"
        )
    gathers = cfg.strategy in (Strategy.ZERO, Strategy.FSDP) or dims.dp > 1
    if _zero_stage(cfg) == 3 and gathers and accounting == "implementation" and not (
            layout.unit if cfg.strategy != Strategy.ZERO else layout.largest_layer):
        notes.append("the gathered-parameter buffers of ZeRO-3/FSDP are not estimated: pass "
                     "largest_layer_params, or n_layer and hidden, or the model itself")
    if cfg.strategy == Strategy.TENSOR and layout.tp_split == 0:
        notes.append("no parameters matched the tensor-parallel plan; parameters are counted unsplit")
    if reduce_bucket_size is None:
        reduce_bucket_size = reduce_bucket_elements(layout.total)
    ranks = tuple(
        _rank_estimate(r, cfg, dims, layout, ppk, mb, accounting, reduce_bucket_size)
        for r in range(world_size)
    )
    worst = max(ranks, key=lambda r: r.total)
    if (
        cfg.strategy == Strategy.ZERO
        and cfg.zero_stage in (1, 2, 3)
        and accounting == "implementation"
        and (worst.buffers > worst.model_states)
    ):
        notes.append(
            f"DeepSpeed's gradient reduction bucket ({reduce_bucket_size:,} elements, allocated "
            "whole) outweighs the model states here; a smaller reduce_bucket_size (ds_config "
            "zero_optimization) saves it"
        )
    return Estimate(
        ranks=ranks,
        num_params=layout.total,
        summary=cfg.summary(world_size),
        bytes_per_param=ppk,
        notes=tuple(notes),
        activation_formula=formula,
        comm_bytes_per_step=comm_bytes_per_step(cfg, dims, layout, mb, ppk),
    )


def _parameter_count(value: Any) -> int:
    """A parameter count as people write it (124_000_000, 7.5e9, "7.5e9"); anything else: ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)) or (
            isinstance(value, str) and not _looks_numeric(value)):
        raise ConfigError(
            "estimate() takes an nn.Module or a parameter count such as 124_000_000 or 7.5e9, "
            f"got {type(value).__name__} {shown(value)}."
        )
    return read_int("num_params", value, maximum=MAX_COUNT)


def _looks_numeric(text: str) -> bool:
    try:
        float(text.replace("_", ""))
    except ValueError:
        return False
    return True


def _size(name: str, value: Any) -> int | None:
    """A shape or batch argument of `estimate`: None (unknown), or a positive int (7.5e9 style too)."""
    return None if value is None else read_int(name, value, maximum=MAX_COUNT)


def _as_config(config: Config | dict[str, Any] | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        unnamed = [key for key in config if not isinstance(key, str)]
        if unnamed:
            raise ConfigError(f"config keys must be setting names, got {shown(unnamed[0])}.")
        return Config().update(**config)
    raise ConfigError(f"config must be an mpnb.Config or a dict, got {type(config).__name__}.")


def _bytes_per_param(
    cfg: Config, optimizer: str, accounting: str, override: tuple[float, float, float] | None
) -> tuple[float, float, float]:
    """(P, G, K) for this strategy and precision: the table in the module docstring."""
    if override is not None:
        values = list(override) if isinstance(override, (list, tuple)) else []
        if len(values) != 3 or not all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                for v in values):
            raise ConfigError(f"bytes_per_param must be three finite numbers >= 0, (P, G, K) "
                              f"(got {shown(override)}); e.g. (2, 2, 12) for bf16 with AdamW.")
        return float(values[0]), float(values[1]), float(values[2])
    moments = OPTIMIZER_STATE_BYTES[optimizer]
    if accounting == "paper":
        return 2.0, 2.0, 4.0 + moments
    if accounting == "deepspeed":
        # DeepSpeed's estimators: 16-bit params; stage 2 adds 16- and 32-bit grads, stage 3 32-bit grads
        return 2.0, (4.0 if _zero_stage(cfg) == 3 else 6.0), 4.0 + moments
    family = "torch"
    if cfg.strategy == Strategy.ZERO:
        family = "zero0" if cfg.zero_stage == 0 else "zero"
    p, g, master = MODEL_STATE_BYTES[(family, cfg.precision)]
    return float(p), float(g), float(master + moments)


def _zero_stage(cfg: Config) -> int:
    """The ZeRO stage that describes how the data-parallel ranks share model states."""
    if cfg.strategy == Strategy.ZERO:
        return cfg.zero_stage
    if cfg.strategy in (Strategy.FSDP, Strategy.TENSOR, Strategy.PIPELINE):
        # FSDP2 shards parameters, gradients and optimizer state; tensor and pipeline compose with it
        # over their data-parallel ranks (with dp = 1 nothing is shared, so this changes nothing)
        return 3
    return 0  # ddp


def _rank_estimate(
    rank: int,
    cfg: Config,
    dims: ParallelDims,
    layout: Layout,
    ppk: tuple[float, float, float],
    mb: int,
    accounting: str,
    bucket: int,
) -> RankEstimate:
    P, G, K = ppk
    dp, tp = dims.dp, dims.tp
    stage = dims.stage_of(rank) if cfg.strategy == Strategy.PIPELINE else 0

    local = layout.stage_params(dims.pp, stage)
    if cfg.strategy == Strategy.TENSOR and tp > 1:  # pipeline and tensor do not compose: local is the model
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

    on_cpu = (0, 0, 0)  # (parameters, gradients, optimizer) in CPU memory
    if cfg.offload == "parameters":
        on_cpu, params, grads, optim = (params, grads, optim), 0, 0, 0
    elif cfg.offload == "optimizer":
        # ZeRO-Offload reduces the gradient partition straight to CPU memory at stages 2-3
        on_cpu = (0, grads if zs >= 2 else 0, optim)
        grads, optim = grads - on_cpu[1], 0

    buffers = _buffers(cfg, layout, local, zs, dp, accounting, bucket)
    acts = activation_bytes(cfg, dims, layout, mb, stage)
    return RankEstimate(
        rank=rank,
        parameters=params,
        gradients=grads,
        optimizer=optim,
        activations=acts,
        buffers=buffers,
        offloaded=sum(on_cpu),
        offloaded_parts=on_cpu,
    )


def _buffers(cfg: Config, layout: Layout, local: int, zs: int, dp: int, accounting: str, bucket: int) -> int:
    compute = COMPUTE_BYTES[cfg.precision]
    if accounting == "deepspeed":
        # DeepSpeed's estimator: 4 bytes per parameter of the largest layer at stage 3, nothing at stage 2
        return 4 * layout.largest_layer if zs == 3 else 0  # 0 when the largest layer is unknown
    if cfg.strategy == Strategy.ZERO:
        if cfg.zero_stage in (1, 2):
            # the gradient reduction bucket, allocated whole in the gradient dtype
            return bucket * compute
        if cfg.zero_stage == 3:
            # the reduction bucket (allocated at initialize and kept), plus the gathered 16-bit
            # parameters and gradients of one layer
            return bucket * compute + 4 * layout.largest_layer
        return 0
    if (zs == 3 and dp > 1) or cfg.strategy == Strategy.FSDP:  # FSDP2 (alone, or under tensor parallelism)
        unit = layout.unit
        if not cfg.reshard_after_forward:
            return int(local * compute)  # gathered parameters stay from forward to backward
        # current and prefetched unit in compute precision, plus one unit's unsharded fp32 gradient
        return int(2 * unit * compute + 4 * unit)
    return 0  # DDP with gradient_as_bucket_view: gradients live in the buckets
