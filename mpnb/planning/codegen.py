"""`Config.to_code()`: the plain PyTorch / DeepSpeed code a config stands for.

A learner reads this to see what mpnb does underneath `mpnb.prepare`; it is a
faithful sketch of the strategy (same APIs, same order: tensor, then pipeline,
then data parallel, as in torchtitan), not mpnb's source. It assumes `model`
(an nn.Module whose repeated blocks are `model.blocks`, like `mpnb.models.GPT`),
`loader` (yielding `(inputs, targets)`) and `loss_fn` exist.
"""

from __future__ import annotations

import pprint
from collections.abc import Callable
from dataclasses import replace

from mpnb.planning.ds_config import to_ds_config
from mpnb.planning.parallel_dims import ParallelDims, Strategy
from mpnb.planning.settings import Settings

# The built-in tensor-parallel plan for mpnb.models.GPT blocks (Megatron: column then row).
DEFAULT_TENSOR_PLAN = {
    "attn.qkv": "colwise",
    "attn.proj": "rowwise",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
}

_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}


def config_code(cfg: Settings, world_size: int, device_kind: str = "cuda") -> str:
    """The script for `cfg` on `world_size` ranks of `device_kind`; `Config.to_code` has validated `cfg`."""
    dims = ParallelDims.from_config(cfg, world_size)
    backend = "nccl" if device_kind == "cuda" else "gloo"
    head = [
        f"# {cfg.summary(world_size)} on {world_size} ranks: what mpnb.prepare(model, optimizer) runs.",
        "# mpnb starts one process per rank and sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.",
        "import datetime",
        "import torch",
        "import torch.distributed as dist",
        "",
        f'dist.init_process_group("{backend}", timeout=datetime.timedelta(seconds=60))',
        "rank, world_size = dist.get_rank(), dist.get_world_size()",
    ]
    if device_kind == "cuda":
        head += [
            'device = torch.device("cuda", 0)  # mpnb binds one GPU per engine via CUDA_VISIBLE_DEVICES',
            "torch.cuda.set_device(device)",
        ]
    else:
        head += ['device = torch.device("cpu")']
    head.append("model = model.to(device)")
    body = _BODIES[Strategy(cfg.strategy)](cfg, dims, device_kind)
    return "\n".join([*head, "", *body]) + "\n"


def _checkpointing(cfg: Settings) -> list[str]:
    """Activation checkpointing comes after the model split and before data-parallel wrapping."""
    if not cfg.activation_checkpointing:
        return []
    return [
        "# activation checkpointing: keep only each block's input, recompute the rest in backward",
        "from torch.distributed._composable import checkpoint",
        "for block in model.blocks:",
        "    checkpoint(block)",
    ]


def _autocast(cfg: Settings, device_kind: str) -> str | None:
    if cfg.precision == "fp32":
        return None
    return f'torch.autocast("{device_kind}", dtype={_DTYPES[cfg.precision]})'


def _loop(cfg: Settings, device_kind: str, *, forward: str = "model(inputs)") -> list[str]:
    """A training loop with gradient accumulation and optional autocast."""
    cast = _autocast(cfg, device_kind)
    lines = [
        f"accum = {cfg.grad_accum_steps}  # micro-batches of {cfg.micro_batch_size} per optimizer step",
        "# each rank reads its own slice of the data (DistributedSampler)",
        "for step, (inputs, targets) in enumerate(loader):",
        "    inputs, targets = inputs.to(device), targets.to(device)",
    ]
    if cast:
        lines += [f"    with {cast}:", f"        loss = loss_fn({forward}, targets) / accum"]
    else:
        lines += [f"    loss = loss_fn({forward}, targets) / accum"]
    lines += [
        "    loss.backward()  # gradients are averaged across data-parallel ranks here",
        "    if (step + 1) % accum == 0:",
        "        optimizer.step()",
        "        optimizer.zero_grad()",
    ]
    return lines


def _ddp(cfg: Settings, dims: ParallelDims, device_kind: str) -> list[str]:
    ids = "device_ids=[0]" if device_kind == "cuda" else ""
    return [
        "# DDP: every rank keeps the whole model, gradients are all-reduced in buckets during backward",
        "from torch.nn.parallel import DistributedDataParallel as DDP",
        *_checkpointing(cfg),
        f"model = DDP(model{', ' + ids if ids else ''})",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)",
        "",
        *_loop(cfg, device_kind),
    ]


def _fsdp_shard_lines(cfg: Settings, mesh: str) -> list[str]:
    args = [f"mesh={mesh}", f"reshard_after_forward={cfg.reshard_after_forward}"]
    lines = []
    if cfg.precision != "fp32":  # compute in 16 bits, keep fp32 shards and reduce gradients in fp32
        lines.append(f"mp_policy = MixedPrecisionPolicy(param_dtype={_DTYPES[cfg.precision]}, "
                     "reduce_dtype=torch.float32)")
        args.append("mp_policy=mp_policy")
    if cfg.offload == "parameters":
        args.append("offload_policy=CPUOffloadPolicy()")
    kwargs = ", ".join(args)
    if cfg.fsdp_wrap:
        names = "{" + ", ".join(repr(n) for n in cfg.fsdp_wrap) + "}"
        lines += [
            "for module in list(model.modules()):",
            f"    if type(module).__name__ in {names}:  # one FSDP unit per wrapped class",
            f"        fully_shard(module, {kwargs})",
        ]
    else:
        lines += [
            "for block in model.blocks:  # one FSDP unit per block: gathered just before it runs",
            f"    fully_shard(block, {kwargs})",
        ]
    lines.append(f"fully_shard(model, {kwargs})  # the rest: embeddings, final norm, head")
    return lines


def _fsdp_imports(cfg: Settings) -> str:
    names = ["MixedPrecisionPolicy", "fully_shard"]
    if cfg.offload == "parameters":
        names.insert(0, "CPUOffloadPolicy")
    return f"from torch.distributed.fsdp import {', '.join(names)}"


def _fsdp(cfg: Settings, dims: ParallelDims, device_kind: str) -> list[str]:
    return [
        "# FSDP2: parameters, gradients and optimizer state are sharded across ranks (ZeRO-3 like);",
        "# each block's parameters are all-gathered just before it runs and freed after",
        "from torch.distributed.device_mesh import init_device_mesh",
        _fsdp_imports(cfg),
        "",
        f'mesh = init_device_mesh("{device_kind}", ({dims.world},))',
        *_checkpointing(cfg),
        *_fsdp_shard_lines(cfg, "mesh"),
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # sees only this rank's shards",
        "",
        # FSDP2 handles mixed precision itself, so the loop needs no autocast
        *_loop(replace(cfg, precision="fp32"), device_kind),
    ]


def _zero(cfg: Settings, dims: ParallelDims, device_kind: str) -> list[str]:
    ds_config = pprint.pformat(to_ds_config(cfg, dims.world), indent=1, width=100, sort_dicts=False)
    what = {
        0: "stage 0: plain data parallelism, nothing sharded",
        1: "stage 1: optimizer state sharded across ranks",
        2: "stage 2: optimizer state and gradients sharded",
        3: "stage 3: optimizer state, gradients and parameters sharded",
    }[cfg.zero_stage]
    return [
        f"# DeepSpeed ZeRO {what}",
        "import deepspeed",
        "",
        *_checkpointing(cfg),
        f"ds_config = {ds_config}",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)",
        "engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)",
        "",
        "for inputs, targets in loader:",
        "    inputs, targets = inputs.to(device), targets.to(device)",
        "    loss = loss_fn(engine(inputs), targets)",
        "    engine.backward(loss)  # reduce (or reduce-scatter) gradients",
        f"    engine.step()  # optimizer step every {cfg.grad_accum_steps} micro-batch(es)",
    ]


def _pipeline(cfg: Settings, dims: ParallelDims, device_kind: str) -> list[str]:
    pp, dp = dims.pp, dims.dp
    schedule = "Schedule1F1B" if cfg.pipeline_schedule == "1f1b" else "ScheduleGPipe"
    if cfg.pipeline_split_points:
        split = [f"# stages start at: {', '.join(cfg.pipeline_split_points)}"]
    else:
        split = ["# split the blocks evenly; stage 0 keeps the embeddings, the last stage the head"]
    lines = [
        f"# Pipeline: the model is cut into {pp} stages; {cfg.microbatches} microbatches of "
        f"{cfg.micro_batch_size // cfg.microbatches} flow through them ({cfg.pipeline_schedule})",
        "from torch.distributed.device_mesh import init_device_mesh",
        f"from torch.distributed.pipelining import PipelineStage, {schedule}",
        "",
        "# pipeline outermost, as in torchtitan: ranks [s*dp, (s+1)*dp) hold stage s",
        f'mesh = init_device_mesh("{device_kind}", ({pp}, {dp}), mesh_dim_names=("pp", "dp"))',
        'stage_index = mesh["pp"].get_local_rank()',
        *split,
        f"per_stage = len(model.blocks) // {pp}",
        "keep = range(stage_index * per_stage, (stage_index + 1) * per_stage)",
        "model.blocks = torch.nn.ModuleList(b for i, b in enumerate(model.blocks) if i in keep)",
        "if stage_index > 0:",
        "    model.tok_emb = model.pos_emb = None",
        f"if stage_index < {pp - 1}:",
        "    model.ln_f = model.head = None",
        *_checkpointing(cfg),
    ]
    if dp > 1:
        # FSDP2, not DDP: DDP around a PipelineStage miscounts gradients with several microbatches
        lines += [
            f"# {dp} data-parallel ranks per stage: FSDP2 shards the stage over them (ZeRO-3 like)",
            _fsdp_imports(cfg),
            *_fsdp_shard_lines(cfg, 'mesh["dp"]'),
        ]
    lines += [
        f'stage = PipelineStage(model, stage_index, {pp}, device, group=mesh["pp"].get_group())',
        f"schedule = {schedule}(stage, n_microbatches={cfg.microbatches}, loss_fn=loss_fn)",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # this stage's parameters only",
        "",
        "for inputs, targets in loader:",
        "    if stage_index == 0:",
        "        schedule.step(inputs.to(device))",
        f"    elif stage_index == {pp - 1}:",
        "        losses = []",
        "        schedule.step(target=targets.to(device), losses=losses)",
        "    else:",
        "        schedule.step()",
        "    optimizer.step()",
        "    optimizer.zero_grad()",
    ]
    return lines


def _tensor(cfg: Settings, dims: ParallelDims, device_kind: str) -> list[str]:
    tp, dp = dims.tp, dims.dp
    styles = {"colwise": "ColwiseParallel()", "rowwise": "RowwiseParallel()"}
    if cfg.tensor_plan:
        plan_lines = [f"    {name!r}: {styles[style]}," for name, style in cfg.tensor_plan.items()]
        heads = "# divide the head count of attention modules with a colwise child by the degree"
    else:
        plan_lines = [f"    {'blocks.*.' + name!r}: {styles[style]},"
                      for name, style in DEFAULT_TENSOR_PLAN.items()]
        heads = (f"for block in model.blocks:\n    block.attn.n_head //= {tp}  "
                 "# each rank computes its share of the heads")
    lines = [
        f"# Tensor parallel: each block's matrices are split over {tp} ranks (Megatron column then row);",
        "# embeddings, layer norms and the head stay whole",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module",
    ]
    if dp > 1:
        lines.append(_fsdp_imports(cfg))
    lines += [
        "",
        f'mesh = init_device_mesh("{device_kind}", ({dp}, {tp}), mesh_dim_names=("dp", "tp"))',
        "plan = {",
        *plan_lines,
        "}",
        'parallelize_module(model, mesh["tp"], plan)',
        heads,
        *_checkpointing(cfg),
    ]
    loop_cfg = cfg
    if dp > 1:
        lines += [f"# {dp} data-parallel groups: shard the tensor-parallel model further with FSDP2"]
        lines += _fsdp_shard_lines(cfg, 'mesh["dp"]')
        loop_cfg = replace(cfg, precision="fp32")  # FSDP2's MixedPrecisionPolicy casts
    lines += [
        "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)",
        "",
        "# tensor-parallel ranks read the same batch; data-parallel groups read different ones",
        *_loop(loop_cfg, device_kind),
    ]
    return lines


_BODIES: dict[Strategy, Callable[[Settings, ParallelDims, str], list[str]]] = {
    Strategy.DDP: _ddp,
    Strategy.FSDP: _fsdp,
    Strategy.ZERO: _zero,
    Strategy.PIPELINE: _pipeline,
    Strategy.TENSOR: _tensor,
}
