"""Which `Config` settings go together, and what a strategy leaves neutral.

`Config.problems` runs `value_problems` (each value on its own) and, when
those pass, `combination_problems` (settings against each other, the world
size and the device kind). Every message names the problem and the fix.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.config_values import coerce, field_kinds, shown
from mpnb.planning.parallel_dims import ParallelDims, Strategy
from mpnb.planning.settings import Settings

DEVICE_KINDS = ("cpu", "cuda")


def value_problems(cfg: Settings) -> list[str]:
    """Values that are wrong on their own, whatever the world size (e.g. after direct construction)."""
    out: list[str] = []
    kinds = field_kinds(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        try:
            coerced = coerce(f.name, kinds[f.name], value)
        except ConfigError as exc:
            out.append(str(exc))
            continue
        # construction stores values in their type, so this is a field assigned afterwards ("8" for 8)
        if coerced != value or not isinstance(coerced, type(value)):
            out.append(f"{f.name}={shown(value)} is not written as mpnb expects; use {shown(coerced)} "
                       f"(or `config.update({f.name}=...)`, which converts text).")
    return out


def combination_problems(cfg: Settings, dims: ParallelDims, device: str | None) -> list[str]:
    """Settings that cannot go together, or do not fit `dims.world` ranks of `device`; each names the fix."""
    out: list[str] = []
    s, pp, tp, world = cfg.strategy, dims.pp, dims.tp, dims.world

    if device == "cpu" and cfg.precision == "fp16":
        out.append("fp16 is not supported on CPU (neither torch nor DeepSpeed train in fp16 there). "
                   "Use precision=bf16 or fp32.")

    # zero_stage belongs to DeepSpeed
    if s == Strategy.PIPELINE and cfg.zero_stage == 3:
        out.append("ZeRO-3 cannot be combined with pipeline stages: it shards every layer's parameters "
                   "across ranks that hold different stages. Use zero_stage=0 with strategy=pipeline.")
    elif s == Strategy.ZERO and pp > 1:
        if cfg.zero_stage >= 2:
            out.append(f"ZeRO-{cfg.zero_stage} cannot be combined with pipeline stages (it shards gradients"
                       f"{' and parameters' if cfg.zero_stage == 3 else ''} that each stage accumulates over "
                       "microbatches). Set pipeline_stages=1, or use strategy=pipeline.")
        else:
            out.append("strategy=zero does not split the model into pipeline stages in mpnb. "
                       "Set pipeline_stages=1, or use strategy=pipeline (stages replicated data-parallel).")
    elif s != Strategy.ZERO and cfg.zero_stage != 0:
        out.append(f"zero_stage={cfg.zero_stage} applies only to strategy=zero (DeepSpeed); "
                   f"set strategy=zero, or zero_stage=0 to use {s}.")

    # model-parallel degrees belong to their strategy
    if s in (Strategy.PIPELINE, Strategy.TENSOR) and world < 2:
        out.append(f"strategy={s} splits the model across ranks and needs at least 2; this world has "
                   f"{world}. Start more ranks, or use ddp.")
    elif s == Strategy.PIPELINE:
        if pp < 2:
            out.append(f"strategy=pipeline needs pipeline_stages >= 2 (got {pp}); "
                       f"set pipeline_stages to a divisor of the world size {world}, e.g. 2.")
    elif pp > 1 and s != Strategy.ZERO:
        out.append(f"pipeline_stages={pp} applies only to strategy=pipeline; "
                   "set strategy=pipeline or pipeline_stages=1.")
    if s == Strategy.TENSOR and world >= 2:
        if tp < 2:
            out.append(f"strategy=tensor needs tensor_parallel >= 2 (got {tp}); "
                       f"set tensor_parallel to a divisor of the world size {world}, e.g. 2.")
    elif tp > 1:
        out.append(f"tensor_parallel={tp} applies only to strategy=tensor; "
                   "set strategy=tensor or tensor_parallel=1.")
    if pp > 1 and tp > 1:
        out.append("Pipeline and tensor parallelism together are not supported yet; choose one of them.")

    out.extend(dims.problems())  # the degrees must tile the world

    # pipeline schedule
    if s == Strategy.PIPELINE:
        if cfg.microbatches < pp:
            out.append(f"microbatches={cfg.microbatches} is fewer than the {pp} pipeline stages, so stages "
                       f"would idle; set microbatches >= {pp} (e.g. {2 * pp}).")
        if cfg.micro_batch_size % cfg.microbatches:
            out.append(f"micro_batch_size={cfg.micro_batch_size} does not split into "
                       f"{cfg.microbatches} equal microbatches; make micro_batch_size a multiple of "
                       "microbatches.")
        if cfg.grad_accum_steps != 1:
            out.append(f"grad_accum_steps={cfg.grad_accum_steps} does not apply to strategy=pipeline: the "
                       "schedule already accumulates gradients over its microbatches. Set grad_accum_steps=1 "
                       "and raise microbatches (or micro_batch_size) instead.")
    elif cfg.microbatches != 1:
        out.append(f"microbatches={cfg.microbatches} applies only to strategy=pipeline; set microbatches=1 "
                   "(use grad_accum_steps to accumulate gradients).")
    if cfg.pipeline_split_points:
        if s != Strategy.PIPELINE:
            out.append("pipeline_split_points applies only to strategy=pipeline; "
                       "clear it or set strategy=pipeline.")
        elif len(cfg.pipeline_split_points) != pp - 1:
            out.append(f"{pp} pipeline stages need {pp - 1} split points, got "
                       f"{len(cfg.pipeline_split_points)} ({', '.join(cfg.pipeline_split_points)}).")
    if cfg.tensor_plan and s != Strategy.TENSOR:
        out.append("tensor_plan applies only to strategy=tensor; clear it or set strategy=tensor.")
    if cfg.fsdp_wrap and s not in (Strategy.FSDP, Strategy.TENSOR):
        out.append("fsdp_wrap applies only to strategy=fsdp (or tensor, which shards with FSDP2 across "
                   "data-parallel ranks); clear it.")

    # offload
    if cfg.offload != "none":
        if s not in (Strategy.ZERO, Strategy.FSDP):
            out.append(f"offload={cfg.offload} needs strategy=zero (DeepSpeed) or fsdp; {s} keeps "
                       "everything on the device. Set offload=none or change strategy.")
        elif s == Strategy.ZERO and cfg.offload == "optimizer" and cfg.zero_stage == 0:
            out.append("offload=optimizer needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads the optimizer "
                       "partition); set zero_stage >= 1.")
        elif s == Strategy.ZERO and cfg.offload == "parameters" and cfg.zero_stage != 3:
            out.append("offload=parameters needs ZeRO stage 3 (only stage 3 partitions parameters); "
                       "set zero_stage=3 or offload=optimizer.")
        elif s == Strategy.FSDP and cfg.offload == "optimizer":
            out.append("FSDP2 offloads parameters, gradients and the optimizer step together "
                       "(CPUOffloadPolicy); use offload=parameters with strategy=fsdp, or strategy=zero "
                       "for optimizer-only offload.")
        elif s == Strategy.FSDP and cfg.offload == "parameters" and device == "cpu":
            out.append("offload=parameters with strategy=fsdp needs an accelerator: FSDP2's CPUOffloadPolicy "
                       "moves shards from the GPU to host memory, and CPU ranks have nothing to offload. "
                       "Use strategy=zero with zero_stage=3 and offload=parameters (works on CPU), or "
                       "offload=none.")
    return out


def neutral_for(strategy: Strategy) -> dict[str, Any]:
    """The values of settings that do not apply to `strategy` (what validate accepts)."""
    out: dict[str, Any] = {}
    if strategy != Strategy.ZERO:
        out["zero_stage"] = 0
    if strategy != Strategy.PIPELINE:
        out.update(pipeline_stages=1, microbatches=1, pipeline_split_points=[])
    if strategy != Strategy.TENSOR:
        out.update(tensor_parallel=1, tensor_plan={})
    if strategy not in (Strategy.ZERO, Strategy.FSDP):
        out["offload"] = "none"
    if strategy not in (Strategy.FSDP, Strategy.TENSOR):
        out["fsdp_wrap"] = []
    return out
