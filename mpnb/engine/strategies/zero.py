"""DeepSpeed ZeRO stages 0-3 through `deepspeed.initialize` on the existing process group.

The ds_config comes from `Config.to_deepspeed` plus what running inside mpnb
needs: the user's torch optimizer (`zero_allow_untested_optimizer`, and
`zero_force_ds_cpu_optimizer: false` when offloading), and
`stage3_param_persistence_threshold: 0`, so stage 3 partitions every parameter
(DeepSpeed's default keeps parameters under 100k elements whole, which on a
teaching-sized model means nothing at all is partitioned), and
`gradient_clipping: 0` (DeepSpeed's default clips at 1.0, which the same loop
under DDP or FSDP does not do, so losses would drift apart), and a
`reduce_bucket_size` capped at the model's parameter count (DeepSpeed's 5e8
elements default is allocated whole: 1.86 GiB in fp32 for a model of any size).

Bytes per parameter Ψ on each of N ranks, as the tensors show them (AdamW;
P = 4 in fp32, 2 in bf16 where the module itself is cast to bf16):

| stage | parameters | gradients | optimizer (fp32 master + exp_avg + exp_avg_sq) |
|---|---|---|---|
| 0 fp32 | 4Ψ | 4Ψ | 8Ψ (no master copy: DeepSpeed steps the torch optimizer on the fp32 params) |
| 0 bf16 | 2Ψ | 2Ψ | 12Ψ (fp32 master + moments, unpartitioned) |
| 1 | PΨ | PΨ (full gradients until the accumulation boundary) | 12Ψ/N |
| 2 | PΨ | PΨ/N | 12Ψ/N |
| 3 | PΨ/N | PΨ/N | 12Ψ/N |

So in fp32 K = 12 at stages 1-3: DeepSpeed keeps an fp32 master partition
even when the parameters are fp32 already. Gradients are counted at their peak
in a step: the full `.grad` tensors at the end of autograd's backward for
stages 0-1, the rank's reduced partition (`averaged_gradients`) for stages 2-3,
whose full gradients still waiting in the reduce bucket at the end of
backward are reported as `buffers` (communication buckets).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from mpnb.engine import ds_ops, quiet
from mpnb.engine.strategies.common import EngineContext, apply_activation_checkpointing
from mpnb.engine.trainer import (
    LossFn,
    Trainer,
    low_precision_dtype,
    move,
    optimizer_state_bytes,
    tensor_bytes,
)
from mpnb.errors import MpnbError
from mpnb.planning.config import Config
from mpnb.planning.estimator import reduce_bucket_elements
from mpnb.planning.parallel_dims import ParallelDims


def deepspeed_config(config: Config, world_size: int, num_params: int) -> dict[str, Any]:
    ds = config.to_deepspeed(world_size)
    zero = ds.setdefault("zero_optimization", {})
    zero["stage3_param_persistence_threshold"] = 0
    zero.setdefault("reduce_bucket_size", reduce_bucket_elements(num_params))
    # DeepSpeed clips gradient norms to 1.0 unless told otherwise; a plain torch loop does not clip
    ds.setdefault("gradient_clipping", 0.0)
    if config.offload != "none":
        ds["zero_force_ds_cpu_optimizer"] = False  # keep the user's torch optimizer when offloading
        for key in ("offload_optimizer", "offload_param"):
            if key in zero:
                zero[key]["pin_memory"] = torch.cuda.is_available()
    ds.pop("activation_checkpointing", None)  # mpnb checkpoints blocks with torch (below)
    ds["steps_per_print"] = 10**9  # DeepSpeed's own progress lines would flood every rank's output
    return ds


class ZeroTrainer(Trainer):
    strategy = "zero"

    def __init__(
        self,
        engine: Any,
        optimizer: Any,
        config: Config,
        dims: ParallelDims,
        loss_fn: LossFn | None,
        **kw: Any,
    ) -> None:
        # DeepSpeed casts the module itself for bf16/fp16: no autocast; inputs are cast instead
        super().__init__(engine, optimizer, config, dims, loss_fn, autocast_dtype=None, **kw)
        self.stage = config.zero_stage
        self._input_dtype = low_precision_dtype(config.precision)
        self._scaler = None
        self._unreduced_grad_bytes = 0
        self._grad_peak = 0

    @property
    def module(self) -> nn.Module:
        return self.model.module

    # ---- step ------------------------------------------------------------------------------------
    def _train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        engine = self.model
        n = self.config.grad_accum_steps
        total = torch.zeros((), device=self.device)
        self._grad_peak = 0
        for i, (x, y) in enumerate(self._micro_batches(inputs, targets)):
            loss = self._loss(engine, move(x, self.device, self._input_dtype), y)  # engine(**x) for dicts
            if i == n - 1:  # sample gradients when autograd finishes, before DeepSpeed reduces them
                loss.register_hook(self._queue_grad_sample)
            engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            total += loss.detach().float() / n
            if i == n - 1:
                self._grad_bytes_at_backward = max(self._grad_peak, self._partition_grad_bytes())
            engine.step()  # steps the optimizer only at the accumulation boundary
        return total

    def _eval_loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        return self._loss(self.model, move(inputs, self.device, self._input_dtype), targets).detach().float()

    def _queue_grad_sample(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._sample_full_grads)

    def _sample_full_grads(self) -> None:
        full = sum(tensor_bytes(p.grad) for p in self.module.parameters())
        if self.stage <= 1:  # stages 0-1 keep whole gradients (stage 1 until the boundary)
            self._grad_peak = full
        else:  # stages 2-3: what is not reduced yet sits in the reduce bucket
            self._unreduced_grad_bytes = full

    def _partition_grad_bytes(self) -> int:
        grads = getattr(self.optimizer, "averaged_gradients", None) or {}
        values = grads.values() if isinstance(grads, dict) else grads
        held = sum(tensor_bytes(g) for group in values if group is not None for g in _flat(group))
        if held == 0:  # with offload the partition's gradients sit on the fp32 masters (host memory)
            held = sum(tensor_bytes(m.grad) for m in self._master_partitions())
        return held

    def _master_partitions(self) -> list[torch.Tensor]:
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            masters = getattr(self.optimizer, attr, None)
            if masters:
                return _flat(masters)
        return []

    # ---- memory ----------------------------------------------------------------------------------
    def _parameter_bytes(self) -> int:
        # stage 3: the rank's partition (ds_tensor) plus whatever is gathered right now (p.data)
        params = self.module.parameters()
        return sum(tensor_bytes(getattr(p, "ds_tensor", None)) + tensor_bytes(p.data) for p in params)

    def _optimizer_bytes(self) -> int:
        opt = self.optimizer
        inner = getattr(opt, "optimizer", opt)
        total = optimizer_state_bytes(inner)
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                     "fp32_groups_flat_partition", "fp32_groups"):
            masters = getattr(opt, attr, None)
            if masters and inner is not opt:  # fp32 master copies (none when DeepSpeed steps torch directly)
                total += sum(tensor_bytes(t) for t in _flat(masters))
                break
        return total

    def _buffer_bytes(self) -> int:
        return self._unreduced_grad_bytes + sum(tensor_bytes(b) for b in self.module.buffers())

    # ---- checkpoints -----------------------------------------------------------------------------
    def _link_optimizer_state(self) -> None:
        """Make sure the optimizer state exists and DeepSpeed knows each param's slice of it.

        Before the first step the torch optimizer has no state (AdamW creates its
        moments lazily) and DeepSpeed has not linked params to state fragments,
        so the safe_get/set_full_optimizer_state calls would fail. A step on zero
        gradients creates the state, as torch.distributed.checkpoint does for its
        own loads; the caller overwrites weights and state afterwards.
        """
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        opt = self.optimizer
        has_state = any(torch.is_tensor(v) and v.numel() > 1
                        for st in inner.state.values() for v in st.values())
        if not has_state:  # stage 0 in fp32 too: no wrapper, the torch optimizer owns the params
            # stage 3 hands its fp32 partitions to the torch optimizer only for the duration of a step
            fill = getattr(opt, "_set_fp32_optimizer_param_groups", None)
            if fill is not None:
                fill()
            masters = [p for group in inner.param_groups for p in group["params"]]
            before = [m.detach().clone() for m in masters]
            for m in masters:
                m.grad = torch.zeros_like(m)
            inner.step()
            with torch.no_grad():  # undo what the step did (weight decay, the step count)
                for m, value in zip(masters, before, strict=True):
                    m.grad = None
                    m.copy_(value)
                for st in inner.state.values():
                    if torch.is_tensor(st.get("step")):
                        st["step"].zero_()
            clear = getattr(opt, "_clear_fp32_optimizer_param_groups", None)
            if clear is not None:
                clear()
            if hasattr(opt, "_hp_optimizer_states_linked"):
                opt._hp_optimizer_states_linked = False
        link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            link()

    def _masters(self) -> dict[int, torch.Tensor]:
        """Module param id -> the fp32 tensor the optimizer steps, where DeepSpeed keeps one per param."""
        opt = self.optimizer
        if not hasattr(opt, "optimizer"):  # stage 0 fp32: the torch optimizer owns the params
            return {id(p): p for p in self.module.parameters()}
        if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # stage 0 bf16/fp16
            return {id(lp): hp for lg, hg in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
                    for lp, hp in zip(lg, hg, strict=True)}
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 weights and optimizer state keyed by parameter name, gathered from the partitions.

        Uses DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_optimizer_state`
        (collectives: every rank calls this), so the dict has the same layout as
        the torch strategies' and loads under any of them.
        """
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._link_optimizer_state()
        masters = self._masters()
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        keys, step = self._state_keys(inner)
        model: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, Any]] = {}
        for name, p in self.module.named_parameters():
            master = masters.get(id(p))
            full = master if master is not None else safe_get_full_fp32_param(p)
            model[name] = full.detach().float().cpu().clone()
            if master is not None:
                entry = {k: v.detach().cpu().clone() for k, v in inner.state.get(master, {}).items()}
            else:
                entry = {k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in keys}
                if step is not None:
                    entry["step"] = step.clone()
            if entry:
                state[name] = entry
        group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        return {
            "model": model,
            "optimizer": {"state": state, "param_groups": [{**group, "params": list(model)}]},
            "steps": self.steps,
            "strategy": self.strategy,
        }

    @staticmethod
    def _state_keys(inner: Optimizer) -> tuple[list[str], torch.Tensor | None]:
        for st in inner.state.values():
            keys = [k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1]
            step = st.get("step")
            return keys, (step.detach().cpu() if torch.is_tensor(step) else None)
        return [], None

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        model_sd, opt_sd = sd["model"], sd.get("optimizer") or {}
        missing = [n for n, _ in self.module.named_parameters() if n not in model_sd]
        if missing:
            raise MpnbError(f"The state dict lacks parameters {missing[:5]}; was it saved from another "
                            "model? Load a dict from trainer.state_dict() of the same model.")
        self._link_optimizer_state()
        masters = self._masters()
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        params = dict(self.module.named_parameters())
        saved_state = opt_sd.get("state", {})
        for name, p in params.items():
            value = model_sd[name].to(self.device)
            master = masters.get(id(p))
            if master is not None:
                with torch.no_grad():
                    master.copy_(value)
                    if master is not p:
                        p.copy_(value)
                if name in saved_state:
                    inner.state[master] = {k: v.to(self.device) if torch.is_tensor(v) else v
                                           for k, v in saved_state[name].items()}
                continue
            safe_set_full_fp32_param(p, value.float())
            for key, v in saved_state.get(name, {}).items():
                if torch.is_tensor(v) and v.numel() > 1:
                    safe_set_full_optimizer_state(p, v.to(self.device).float(), key)
        if not masters:
            self._set_step(inner, saved_state)
            self._refresh_low_precision(params, model_sd)
        self.steps = sd.get("steps", 0)

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's fp32 partitions (stages 1-3) or whole fp32 tensors (stage 0), as views."""
        from mpnb.engine.checkpoint.zero_state import zero_checkpoint_state

        self._link_optimizer_state()
        return zero_checkpoint_state(self, self._masters())

    def finish_checkpoint_load(self, state: dict[str, Any]) -> None:
        from mpnb.engine.checkpoint.zero_state import zero_finish_load

        zero_finish_load(self, state, self._masters())

    @staticmethod
    def _set_step(inner: Optimizer, saved_state: dict[str, dict[str, Any]]) -> None:
        steps = [s["step"] for s in saved_state.values() if "step" in s]
        if not steps:
            return
        for st in inner.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = steps[0].to(st["step"].device, st["step"].dtype)
            elif "step" in st:
                st["step"] = float(steps[0])

    def _refresh_low_precision(self, params: dict[str, nn.Parameter], model_sd: dict[str, Any]) -> None:
        """Make the module's own (bit16 or fp32) params equal the loaded fp32 masters."""
        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
                for name, p in params.items():
                    p.copy_(model_sd[name].to(p.device, p.dtype))
        else:
            self.optimizer.update_lp_params()


def _flat(x: Any) -> list[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    out: list[torch.Tensor] = []
    for item in x or []:
        out.extend(_flat(item))
    return out


def prepare(
    model: nn.Module,
    optimizer: Optimizer,
    config: Config,
    dims: ParallelDims,
    ctx: EngineContext,
    loss_fn: LossFn | None,
) -> Trainer:
    # one line instead of silence while DeepSpeed starts; its own output goes to the engine's log
    print(f"mpnb: preparing ZeRO-{config.zero_stage} (DeepSpeed) ...", flush=True)
    ds_ops.wait()  # the engine's background warm-up: DeepSpeed imported, its ops loaded
    ds_ops.use_own_ninja()  # also outside mpnb's engines: the ninja the ops were built with
    model.to(ctx.device)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    with quiet.captured():
        import deepspeed

        ds_ops.clear_stale_locks()  # else DeepSpeed's op load waits forever on a killed build's lock

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=deepspeed_config(config, ctx.world_size, sum(p.numel() for p in model.parameters())),
            dist_init_required=False,
        )
    return ZeroTrainer(engine, ds_optimizer, config, dims, loss_fn, device=ctx.device, dp_rank=ctx.rank)
