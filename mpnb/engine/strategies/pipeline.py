"""Pipeline parallelism with `torch.distributed.pipelining` (PipelineStage + GPipe / 1F1B).

The model is cut between blocks into `pipeline_stages` consecutive stages;
each rank keeps only its stage (the other layers are dropped, so parameters,
gradients and optimizer state are ~1/pp of the model per rank). A batch is
split into `microbatches` that flow through the stages like an assembly line:
GPipe runs all forwards then all backwards, 1F1B interleaves them so fewer
activations are alive at once.

How a model is cut (in place, keeping parameter names, so checkpoints load
across strategies):
- `nn.Sequential`: by its children; split points are child names ("3").
- otherwise: its repeated blocks must be a top-level `nn.ModuleList` (e.g.
  `blocks`); split points are block names ("blocks.2"). Modules registered
  before the blocks (embeddings) stay on the first stage, those after (final
  norm, head) on the last, and the others are set to None, so the model's
  forward must skip missing modules, as `mpnb.models.GPT` and torchtitan's
  models do.

With pipeline_stages < world size, each stage is sharded data-parallel with
FSDP2 over the "dp" dim of a 2-D (pp, dp) mesh, as torchtitan does (DDP around
a stage gave wrong gradients with several microbatches in torch 2.13: its
bucket rebuild sees each parameter once per microbatch). Memory per rank is
then ~(P + G + K)·Ψ/(pp·dp).

A transformers causal LM is cut where its `config.base_model_pp_plan` says
(`hf_pipeline`), and trains on dict batches (input_ids into the first stage,
the other keys to every stage, labels to the loss) with the model's own loss.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from mpnb.engine.batches import cross_entropy
from mpnb.engine.strategies import hf_pipeline
from mpnb.engine.strategies.common import (
    EngineContext,
    apply_activation_checkpointing,
    close_names,
    parameter_names,
    trainer_on_mesh,
)
from mpnb.engine.strategies.fsdp import apply_fsdp
from mpnb.engine.trainer import LossFn, Trainer, low_precision_dtype, to_cpu
from mpnb.errors import MpnbError
from mpnb.planning import hf_plans
from mpnb.planning.config import Config
from mpnb.planning.model_shape import even_stage_starts, find_blocks
from mpnb.planning.parallel_dims import ParallelDims


# ---- splitting --------------------------------------------------------------------------------------
def stage_boundaries(names: list[str], pp: int, split_points: list[str], owner: str) -> list[int]:
    """Start index of each stage in `names` (the cuttable units), from split points or evenly."""
    if len(names) < pp:
        raise MpnbError(
            f"{owner} has {len(names)} blocks, fewer than pipeline_stages={pp}; every stage needs at least "
            f"one. Use pipeline_stages <= {len(names)}."
        )
    if not split_points:
        return even_stage_starts(len(names), pp)
    starts = [0]
    for point in split_points:
        if point not in names:
            raise MpnbError(
                f"pipeline split point {point!r} is not a block of {owner}, so the pipeline cannot start a "
                f"stage there. Blocks: {', '.join(names)} (close: {close_names(point, names)})."
            )
        starts.append(names.index(point))
    if starts != sorted(set(starts)) or starts[1] == 0:
        raise MpnbError(
            f"pipeline_split_points {split_points} must name blocks in model order, each after the one "
            f"before and none at the very start ({names[0]})."
        )
    return starts


def split_model(model: nn.Module, pp: int, stage: int, split_points: list[str]) -> nn.Module:
    """This stage's part of `model`, with the original parameter names. Raises MpnbError if unsplittable."""
    owner = type(model).__name__
    if isinstance(model, nn.Sequential):
        children = list(model.named_children())
        starts = [*stage_boundaries([n for n, _ in children], pp, split_points, owner), len(children)]
        return nn.Sequential(OrderedDict(children[starts[stage] : starts[stage + 1]]))

    found = find_blocks(model)
    top = dict(model.named_children())
    if found is None or found[0] not in top or not isinstance(found[1], nn.ModuleList):
        where = f" (its repeated blocks are {found[0]!r}, nested inside another module)" if found else ""
        raise MpnbError(
            f"The pipeline splitter cannot split {owner}{where}: it needs an nn.Sequential, or a model whose "
            "blocks are a top-level nn.ModuleList and whose forward skips modules set to None (like "
            "mpnb.models.GPT). Wrap the layers in nn.Sequential, or use strategy=fsdp/zero/tensor."
        )
    blocks_name, blocks = found
    names = [f"{blocks_name}.{i}" for i in range(len(blocks))]
    starts = [*stage_boundaries(names, pp, split_points, owner), len(blocks)]
    keep = range(starts[stage], starts[stage + 1])
    # a ModuleDict keyed by the original index keeps names like "blocks.3.attn.qkv.weight"
    setattr(model, blocks_name, nn.ModuleDict({str(i): blocks[i] for i in keep}))
    order = list(top)
    position = order.index(blocks_name)
    for i, name in enumerate(order):
        if (i < position and stage != 0) or (i > position and stage != pp - 1):
            setattr(model, name, None)
    return model


# ---- trainer ----------------------------------------------------------------------------------------
class PipelineTrainer(Trainer):
    strategy = "pipeline"

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        config: Config,
        dims: ParallelDims,
        loss_fn: LossFn | None,
        *,
        schedule: Any,
        stage_index: int,
        pp_group: Any,
        tied: hf_pipeline.TiedGradients | None = None,
        stage_loss: hf_pipeline.StageLoss | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(model, optimizer, config, dims, loss_fn, **kw)
        self.schedule = schedule
        self.stage_index, self.num_stages, self.pp_group = stage_index, dims.pp, pp_group
        self.tied, self.stage_loss = tied, stage_loss
        self._scaler = None  # pipelining runs its own backward; fp16 loss scaling is not wired here

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _run(self, inputs: Any, targets: Any, *, train: bool) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        args: tuple[Any, ...] = (inputs,) if self.is_first else ()
        kwargs: dict[str, Any] = {}
        if isinstance(inputs, dict):  # a dict batch: every stage gets the masks, the first the token ids
            args, kwargs = hf_pipeline.schedule_inputs(inputs, self.is_first)
        if self.stage_loss is not None:
            self.stage_loss.own = isinstance(inputs, dict)
        with self._autocast():
            if self.is_last:
                run(*args, target=targets, losses=losses, **kwargs)
            else:
                run(*args, **kwargs)
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        local = self._run(inputs, targets, train=True)
        if self.tied is not None:
            self.tied.sync(self.model)
        self._grad_bytes_at_backward = self._gradient_bytes()
        self.optimizer.step()
        return local

    def _eval_loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        return self._run(inputs, targets, train=False)

    def _global_mean(self, local: torch.Tensor) -> float:
        # only last stages hold a loss: sum theirs over the whole world, divided by the dp replicas
        value = local.clone() if self.is_last else torch.zeros((), device=self.device)
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return float(value / self.dp_size)

    # ---- checkpoints: each stage holds some names; gather them into one full dict ----------------
    def state_dict(self) -> dict[str, Any]:
        own = super().state_dict()
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(
            parts, {"model": own["model"], "optimizer": own.get("optimizer")}, group=self.pp_group
        )
        model: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for part in parts:
            model.update(part["model"])
            opt = part["optimizer"] or {}
            state.update(opt.get("state", {}))
            for i, group in enumerate(opt.get("param_groups", [])):
                if i < len(groups):
                    groups[i]["params"] = groups[i]["params"] + list(group["params"])
                else:
                    groups.append({**group, "params": list(group["params"])})
        return {
            "model": model,
            "optimizer": {"state": state, "param_groups": groups},
            "steps": self.steps,
            "strategy": self.strategy,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        mine = set(get_model_state_dict(self.model))
        opt = sd.get("optimizer") or {}
        local = {
            "model": {k: v for k, v in sd["model"].items() if k in mine},
            "optimizer": to_cpu(
                {
                    "state": {k: v for k, v in opt.get("state", {}).items() if k in mine},
                    "param_groups": [
                        {**g, "params": [p for p in g["params"] if p in mine]}
                        for g in opt.get("param_groups", [])
                    ],
                }
            )
            if opt
            else None,
            "steps": sd.get("steps", 0),
        }
        super().load_state_dict(local)


def prepare(
    model: nn.Module,
    optimizer: Optimizer,
    config: Config,
    dims: ParallelDims,
    ctx: EngineContext,
    loss_fn: LossFn | None,
) -> Trainer:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp = dims.pp
    if config.grad_accum_steps != 1:
        raise MpnbError(
            "strategy=pipeline accumulates over its microbatches already; set grad_accum_steps=1 "
            "and raise microbatches (or micro_batch_size) instead."
        )
    stage_index = dims.stage_of(ctx.rank)
    hf = hf_plans.is_transformers_model(model)
    tied = hf and hf_pipeline.tied_head(model)
    stage_loss = hf_pipeline.StageLoss(model, loss_fn) if hf else None
    if hf:  # checked before any collective: a model without a plan, more stages than layers
        stage_module = split_hf(model, pp, stage_index, list(config.pipeline_split_points))
        # named after the cut: a tied weight is named for the module this stage keeps (embedding or head)
        names = parameter_names(stage_module)
    else:
        names = parameter_names(model)
        stage_module = split_model(model, pp, stage_index, list(config.pipeline_split_points))
    stage_module.to(ctx.device)
    if config.activation_checkpointing:
        apply_activation_checkpointing(stage_module)
    mesh = dims.build_mesh(ctx.device.type)
    wrapped: nn.Module = stage_module
    if dims.dp > 1:
        wrapped = apply_fsdp(stage_module, mesh["dp"], config)  # shards in place: the same module
    stage = PipelineStage(wrapped, stage_index, pp, ctx.device, group=mesh["pp"].get_group())
    schedule_cls = Schedule1F1B if config.pipeline_schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(
        stage, n_microbatches=config.microbatches, loss_fn=stage_loss or loss_fn or cross_entropy
    )
    return trainer_on_mesh(
        PipelineTrainer, wrapped, optimizer, names, mesh, config, dims, ctx, loss_fn,
        autocast_dtype=low_precision_dtype(config.precision),
        schedule=schedule, stage_index=stage_index, pp_group=mesh["pp"].get_group(),
        tied=hf_pipeline.TiedGradients(dims, ctx.rank, stage_index) if tied else None, stage_loss=stage_loss,
    )


def split_hf(model: nn.Module, pp: int, stage: int, split_points: list[str]) -> nn.Module:
    """This stage's part of a transformers causal LM, cut between the layers its pp plan names."""
    blocks = hf_pipeline.block_names(model, pp)
    starts = [*stage_boundaries(blocks, pp, split_points, type(model).__name__), len(blocks)]
    keep = range(starts[stage], starts[stage + 1])
    return hf_pipeline.split_hf_model(model, blocks, keep, first=stage == 0, last=stage == pp - 1)
