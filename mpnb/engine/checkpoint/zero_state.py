"""A DeepSpeed ZeRO trainer's checkpoint state: this rank's fp32 partitions, as views, nothing gathered.

`zero_checkpoint_state` names the fp32 master weights and optimizer moments the
rank holds by the unwrapped model's parameter names, in the layout every other
strategy uses (`{"model": {fqn: t}, "optim": {"state": {fqn: {name: t}}}}`),
so a ZeRO checkpoint resumes under FSDP or tensor parallel and the other way:

- stages 1-2: each bit16 param's `_hp_mapping` gives the range of it this rank
  owns (`lp_fragment_address`) and views of that range in the flat fp32
  partition and in the optimizer's flat moments (DeepSpeed has no public
  local API for these stages);
- stage 3: `safe_get_local_fp32_param` / `safe_get_local_optimizer_state`
  return the rank's partition of each param, which starts at
  rank x partition size of the flattened param (the last one padded: cut off);
- stage 0 (and the per-param masters of stage 0 in bf16/fp16): whole tensors,
  which DCP writes once however many ranks hold them.

Partitions are `FlatShard`s: DCP writes and reads them in place, in any other
layout. `zero_finish_load` then makes the bit16 weights DeepSpeed computes with
equal the loaded fp32 masters, and sets the optimizer's step count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpnb.engine.checkpoint.flat_shards import FlatShard
from mpnb.errors import CheckpointError

State = dict[str, Any]


def zero_checkpoint_state(trainer: Any, masters: dict[int, torch.Tensor]) -> State:
    """Views of what this rank holds; `masters` is `ZeroTrainer._masters()` (whole fp32 tensors, stage 0).

    Call after the optimizer state exists and is linked to the params
    (`ZeroTrainer._link_optimizer_state`): the moments are views into it.
    """
    module, opt = trainer.module, trainer.optimizer
    inner = getattr(opt, "optimizer", opt)
    named = _named_parameters(module)
    if masters:
        model, state = _whole(named, masters, inner)
    elif hasattr(opt, "fp32_partitioned_groups_flat"):
        model, state = _stage3(named, opt, inner)
    elif hasattr(opt, "single_partition_of_fp32_groups"):
        model, state = _stage12(named, opt, inner)
    else:
        raise CheckpointError(f"mpnb cannot checkpoint DeepSpeed's {type(opt).__name__} optimizer wrapper "
                              "without gathering it. Use ZeRO stage 0-3 with a torch optimizer.")
    _add_aliases(module, model)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(state)}
              for g in inner.param_groups]
    if len(groups) > 1:  # several groups: name which params each one holds
        groups = _named_groups(named, opt, masters, groups)
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def zero_finish_load(trainer: Any, state: State, masters: dict[int, torch.Tensor]) -> None:
    """After DCP loaded into `state`'s views: bit16 weights from the fp32 masters, the step count.

    Every rank calls this (stages 1-2 all-gather the bit16 partitions).
    `trainer.steps` is left to the caller.
    """
    module, opt = trainer.module, trainer.optimizer
    inner = getattr(opt, "optimizer", opt)
    named = _named_parameters(module)
    with torch.no_grad():
        if masters:  # stage 0: the optimizer's tensors were loaded in place, step included
            saved = state.get("optim", {}).get("state", {})
            for name, p in named:
                master = masters[id(p)]
                if master is not p:
                    p.copy_(master)
                for k, v in saved.get(name, {}).items():
                    if not torch.is_tensor(v):  # a plain number (a float step): DCP replaced it, not in place
                        inner.state[master][k] = v
            return
        step = _saved_step(state.get("optim", {}).get("state", {}))
        if step is not None:
            for st in inner.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"].fill_(step)
                elif "step" in st:
                    st["step"] = step
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            _refresh_stage3(named)
        else:
            opt.update_lp_params()  # bit16 partition from the fp32 one, then an all-gather


# ---- the three layouts -------------------------------------------------------------------------


def _whole(named: list[tuple[str, nn.Parameter]], masters: dict[int, torch.Tensor],
           inner: Any) -> tuple[State, State]:
    model: State = {}
    state: State = {}
    for name, p in named:
        master = masters[id(p)]
        model[name] = master
        if inner.state.get(master):
            state[name] = dict(inner.state[master])  # the live tensors: DCP loads into them in place
    return model, state


def _stage12(named: list[tuple[str, nn.Parameter]], opt: Any, inner: Any) -> tuple[State, State]:
    keys, step = _moment_keys_and_step(inner, opt.single_partition_of_fp32_groups)
    model: State = {}
    state: State = {}
    for name, p in named:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # this rank owns none of it: an empty range keeps the names alike on all ranks
            model[name] = _empty(p.shape, p.device)
            state[name] = {k: _empty(p.shape, p.device) for k in keys}
        else:
            start = mapping.lp_fragment_address.start
            model[name] = FlatShard(mapping.hp_fragment, p.shape, start)
            state[name] = {k: FlatShard(mapping.get_optim_state_fragment(k), p.shape, start) for k in keys}
        if step is not None:
            state[name]["step"] = step.clone()
    return model, state


def _stage3(named: list[tuple[str, nn.Parameter]], opt: Any, inner: Any) -> tuple[State, State]:
    import torch.distributed as dist

    if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
        raise CheckpointError("mpnb's checkpoints cannot read ZeRO-3 state swapped out to NVMe. "
                              "Offload to the CPU instead (offload='cpu') to save or load.")
    keys, step = _moment_keys_and_step(inner, opt.fp32_partitioned_groups_flat)
    model: State = {}
    state: State = {}
    for name, p in named:
        shape, size = p.ds_shape, p.ds_tensor.ds_numel
        start = size * dist.get_rank(group=p.ds_process_group)
        held = max(0, min(size, p.ds_numel - start))  # the last rank's partition ends in padding
        first = min(start, p.ds_numel)
        model[name] = FlatShard(_local_view(opt, p, None)[:held], shape, first)
        state[name] = {k: FlatShard(_local_view(opt, p, k)[:held], shape, first) for k in keys}
        if step is not None:
            state[name]["step"] = step.clone()
    return model, state


def _local_view(opt: Any, p: nn.Parameter, key: str | None) -> torch.Tensor:
    """The rank's fp32 partition of `p` (or of its moment `key`) as a view into DeepSpeed's flat buffer."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    local = safe_get_local_fp32_param(p) if key is None else safe_get_local_optimizer_state(p, key)
    group, offset, numel = opt.grad_position[opt.get_param_id(p)]
    flat = opt.fp32_partitioned_groups_flat[group]
    base = flat if key is None else opt.optimizer.state[flat][key]
    if local.device != base.device:  # offloaded: the public API copied it to the accelerator
        local = base.narrow(0, offset, numel)
    return local


def _refresh_stage3(named: list[tuple[str, nn.Parameter]]) -> None:
    """Each param's bit16 partition (ds_tensor) from its fp32 master partition, as a ZeRO-3 step ends."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_local_fp32_param

    for name, p in named:
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise CheckpointError(f"ZeRO-3 has {name} gathered while loading a checkpoint; load between "
                                  "steps, outside a forward pass or a GatheredParameters block.")
        p.ds_tensor.data.copy_(safe_get_local_fp32_param(p).to(p.ds_tensor.device))


# ---- helpers -----------------------------------------------------------------------------------


def _named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _add_aliases(module: nn.Module, model: State) -> None:
    """Tied weights (an LM head sharing the embedding) under every name, as torch's state dicts list them."""
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first and name not in model and first[id(p)] in model:
            model[name] = model[first[id(p)]]
        first.setdefault(id(p), name)


def _moment_keys_and_step(inner: Any, flats: list[torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
    """The optimizer's per-element state names (exp_avg, ...) and its step count as a 0-d float tensor."""
    for flat in flats:
        st = inner.state.get(flat)
        if st:
            keys = [k for k, v in st.items() if torch.is_tensor(v) and v.shape == flat.shape]
            step = st.get("step")
            if step is not None:
                step = torch.tensor(float(step), dtype=torch.float32)
            return keys, step
    return [], None


def _saved_step(state: State) -> float | None:
    for entry in state.values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if step is not None:
            return float(step)
    return None


def _empty(shape: torch.Size, device: torch.device) -> FlatShard:
    return FlatShard(torch.empty(0, dtype=torch.float32, device=device), shape, 0)


def _named_groups(named: list[tuple[str, nn.Parameter]], opt: Any, masters: dict[int, torch.Tensor],
                  groups: list[State]) -> list[State]:
    """Which user param group each name is in, from the layout DeepSpeed keeps per group."""
    index: dict[int, int] = {}
    if masters:
        inner_groups = getattr(opt, "optimizer", opt).param_groups
        by_master = {id(m): i for i, g in enumerate(inner_groups) for m in g["params"]}
        index = {id(p): by_master.get(id(masters[id(p)]), 0) for _, p in named}
    elif hasattr(opt, "bit16_groups"):
        index = {id(p): i for i, g in enumerate(opt.bit16_groups) for p in g}
    elif hasattr(opt, "fp16_groups"):  # stage 3: sub-groups, each in one user group
        index = {id(p): opt.sub_group_to_group_id.get(i, 0) for i, g in enumerate(opt.fp16_groups) for p in g}
    for g in groups:
        g["params"] = []
    for name, p in named:
        groups[index.get(id(p), 0)]["params"].append(name)
    return groups
