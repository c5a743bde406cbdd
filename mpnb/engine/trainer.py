"""`Trainer`: one training step under whatever strategy `mpnb.prepare` applied.

The base class is the torch-native loop (DDP, FSDP2, tensor parallel, and one
process without a process group); DeepSpeed and pipeline override the parts
that differ (`_train_step`, `_eval_loss`, the memory and checkpoint hooks).

Data: every rank calls `step(batch)` with the same *global* batch, and the
trainer keeps its data-parallel rank's contiguous slice of rows (`shard`).
Ranks that differ only in the model-parallel dimensions (tensor, pipeline) see
the same slice. So the loss of a run depends on the global batch only, and
matches a single-process run on the same batches. If a DataLoader already
yields per-rank batches, pass `step(batch, sharded=True)`.

A batch is an (inputs, targets) pair or, as transformers users have it, a
dict of tensors with "labels" that the model computes its own loss from
(`mpnb.engine.batches`); every tensor's rows are split the same way.

Loss: `step` returns the global mean loss (mean over the data-parallel ranks
of each rank's mean loss; slices are equal, so this is the mean over the
global batch), the same float on every rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.engine import state
from mpnb.engine.activations import ActivationTracker
from mpnb.engine.batches import LABELS, LossFn, check_batch, cross_entropy, is_dict_batch, model_loss
from mpnb.engine.checkpoint.trainer_methods import TrainerCheckpoints
from mpnb.engine.param_counts import ParameterCounts, count_parameters, held_as
from mpnb.errors import MpnbError
from mpnb.planning.config import Config
from mpnb.planning.parallel_dims import ParallelDims

# an (inputs, targets) pair, or a mapping of tensors with "labels" (transformers style): see batches.py
Batch = tuple[Any, Any] | Mapping[str, Any]


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit compute dtype of `Config.precision`; None for fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds for `t`: the local shard of a DTensor, else the tensor itself."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor (FSDP2 / tensor parallel): count the local shard only
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes in the optimizer's per-parameter state (Adam moments, momentum, step counters)."""
    if optimizer is None:
        return 0
    return sum(
        tensor_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


def split_rows(x: Any, parts: int, index: int | None = None) -> Any:
    """Split a tensor (or a tuple/list/dict of tensors) into `parts` equal row chunks along dim 0."""
    if torch.is_tensor(x):
        if x.shape[0] % parts:
            raise MpnbError(
                f"A batch of {x.shape[0]} rows cannot be split into {parts} equal parts "
                f"(data-parallel ranks x grad_accum_steps, or pipeline microbatches). "
                f"Use a global batch size that is a multiple of {parts}."
            )
        chunks = x.chunk(parts)
        return chunks if index is None else chunks[index]
    if isinstance(x, dict):
        split = {k: split_rows(v, parts, index) for k, v in x.items()}
        if index is not None:
            return split
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    if isinstance(x, (tuple, list)):
        split = [split_rows(v, parts, index) for v in x]
        if index is not None:
            return type(x)(split)
        return [type(x)(v[i] for v in split) for i in range(parts)]
    raise MpnbError(f"Cannot split a batch element of type {type(x).__name__}; pass tensors.")


def move(x: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Move tensors to `device`, casting floating ones to `float_dtype` when given."""
    if torch.is_tensor(x):
        if float_dtype is not None and x.is_floating_point():
            return x.to(device=device, dtype=float_dtype)
        return x.to(device)
    if isinstance(x, dict):
        return {k: move(v, device, float_dtype) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(move(v, device, float_dtype) for v in x)
    return x


class Trainer(TrainerCheckpoints):
    """Forward, backward and optimizer step for one prepared model on this rank.

    Attributes: `model` (the wrapped model: DDP, FSDP2-sharded, TP-parallelised,
    a DeepSpeed engine, or this rank's pipeline stage), `optimizer`, `config`
    (the `mpnb.Config` applied), `dims` (its `ParallelDims` on this world),
    `loss_fn`, `steps` (optimizer steps taken). `autocast_dtype` is the dtype
    the forward runs under `torch.autocast` in, None for none: strategies whose
    wrapper casts by itself (FSDP2's MixedPrecisionPolicy, DeepSpeed) pass None.
    """

    strategy = "local"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: Config,
        dims: ParallelDims,
        loss_fn: LossFn | None = None,
        *,
        device: torch.device | None = None,
        dp_rank: int = 0,
        dp_group: dist.ProcessGroup | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.dims = dims
        self.loss_fn: LossFn = loss_fn or cross_entropy
        self.user_loss_fn = loss_fn  # None: a dict batch's model computes its own loss (outputs.loss)
        self.device = device or torch.device("cpu")
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dims.dp, dp_group
        self.steps = 0
        self.staging_buffers: dict[str, torch.Tensor] = {}  # a background save's CPU copy, for the next
        self.total_parameters: int | None = None  # the whole model's count, set by prepare (pipeline)
        self._grad_bytes_at_backward = 0
        self.activation_tracker = ActivationTracker()  # saved-for-backward bytes, for the memory chart
        self.autocast_dtype = autocast_dtype
        self._scaler = torch.amp.GradScaler(self.device.type) if config.precision == "fp16" else None
        self.lr_scheduler: Any = None  # stepped after each optimizer step; set by prepare(lr_scheduler=...)

    # ---- data ------------------------------------------------------------------------------------
    def shard(self, batch: Batch) -> Batch:
        """This data-parallel rank's contiguous slice of the rows of a global batch."""
        if self.dp_size == 1:
            return batch
        return split_rows(batch, self.dp_size, self.dp_rank)

    def _prepare_batch(self, batch: Batch, sharded: bool) -> tuple[Any, Any]:
        """(inputs, targets) on this rank's device; a dict batch's inputs keep "labels" (= targets).

        Checked before anything collective runs (`batches.check_batch`), so a bad batch
        raises the same MpnbError on every rank.
        """
        batch = check_batch(batch, self.model, self.user_loss_fn)
        local = move(batch if sharded else self.shard(batch), self.device)
        if isinstance(local, dict):
            return local, local[LABELS]
        return local

    def _loss(self, model: nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
        """The loss of one forward; `batches.model_loss` decides between the model's own and `loss_fn`."""
        return model_loss(model, inputs, targets, self.user_loss_fn)

    # ---- the step --------------------------------------------------------------------------------
    def step(self, batch: Batch, *, sharded: bool = False) -> float:
        """One optimizer step on a global batch; returns the global mean loss (same on every rank)."""
        observer = state.step_observer  # set while `mpnb.compare` measures this cell
        if observer is not None:
            return observer.observe(self, batch, sharded, lambda: self._step(batch, sharded))
        return self._step(batch, sharded)

    def _step(self, batch: Batch, sharded: bool) -> float:
        inputs, targets = self._prepare_batch(batch, sharded)
        with self.activation_tracker.step(self.steps):
            local = self._train_step(inputs, targets)
        self.steps += 1
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():  # a rebuilt optimizer lacks the wrapper the scheduler looks for
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.step()
        return self._global_mean(local)

    @torch.no_grad()
    def eval_step(self, batch: Batch, *, sharded: bool = False) -> float:
        """Loss on a global batch without updating anything."""
        inputs, targets = self._prepare_batch(batch, sharded)
        self.model.eval()
        try:
            local = self._eval_loss(inputs, targets)
        finally:
            self.model.train()
        return self._global_mean(local)

    def generate(self, input_ids: torch.Tensor, **generate_kwargs: Any) -> torch.Tensor:
        """`model.generate` of a causal LM after training: call it on every rank; CPU token ids on each.

        Greedy unless `do_sample=True` (then every rank samples from `seed=`, default 0), so
        sharded strategies run the same forwards everywhere (`mpnb.engine.generation`).
        """
        from mpnb.engine.generation import generate

        with self._autocast():
            return generate(self.model, self.strategy, self.device, input_ids, **generate_kwargs)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on all but the last accumulation micro-step (DDP, FSDP2)."""
        return contextlib.nullcontext()

    def _micro_batches(self, inputs: Any, targets: Any) -> Iterator[tuple[Any, Any]]:
        n = self.config.grad_accum_steps
        if n == 1:
            yield inputs, targets
        elif is_dict_batch(inputs):  # the labels travel inside each micro-batch's dict
            yield from ((x, x[LABELS]) for x in split_rows(inputs, n))
        else:
            yield from zip(split_rows(inputs, n), split_rows(targets, n), strict=True)

    def _train_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        n = self.config.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(self._micro_batches(inputs, targets)):
            with self._no_sync(i == n - 1), self._autocast():
                loss = self._loss(self.model, x, y) / n
            (self._scaler.scale(loss) if self._scaler else loss).backward()
            total += loss.detach().float()
        self._grad_bytes_at_backward = self._gradient_bytes()
        if self._scaler:
            self._scaler.step(self.optimizer)
            self._scaler.update()
        else:
            self.optimizer.step()
        return total

    def _eval_loss(self, inputs: Any, targets: Any) -> torch.Tensor:
        with self._autocast():
            return self._loss(self.model, inputs, targets).detach().float()

    def _global_mean(self, local: torch.Tensor) -> float:
        if self.dp_size > 1:
            local = local.clone()
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.dp_group)
            local /= self.dp_size
        return float(local)

    # ---- memory ----------------------------------------------------------------------------------
    def _parameter_bytes(self) -> int:
        return sum(tensor_bytes(p) for p in self.model.parameters())

    def _gradient_bytes(self) -> int:
        return sum(tensor_bytes(p.grad) for p in self.model.parameters())

    def _optimizer_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def _buffer_bytes(self) -> int:
        return sum(tensor_bytes(b) for b in self.model.buffers())

    def parameter_counts(self) -> ParameterCounts:
        """Parameters of the whole model and how many this rank holds (its shard, partition or stage).

        Use it instead of `model.num_parameters()`, which counts 0 under ZeRO-3
        (the rank's partition sits in `ds_tensor`) and one stage under pipeline.
        """
        stage = getattr(self, "stage_index", None)  # pipeline only
        held = held_as(self.strategy, self.config.zero_stage, self.dp_size, stage)
        return count_parameters(self.model.parameters(), self.total_parameters, held)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model state this rank holds, counted from its local tensors and shards.

        `gradients` is what the rank held at the end of the last backward (the
        peak of a step: some strategies free gradients in the optimizer step);
        `activations` what autograd saved for backward at the peak of the last step
        (`mpnb.engine.activations`); `buffers` are module buffers plus communication
        buffers the strategy keeps.
        """
        return {
            "parameters": self._parameter_bytes(),
            "gradients": self._grad_bytes_at_backward,
            "optimizer": self._optimizer_bytes(),
            "activations": self.activation_tracker.peak,
            "buffers": self._buffer_bytes(),
        }

    # ---- checkpoints in memory (small models; TrainerCheckpoints writes sharded ones to disk) ------
    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) model and optimizer state keyed by parameter names, on every rank.

        Gathers everything onto every rank: for small models. `save` writes shards instead.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        sd: dict[str, Any] = {
            "model": {k: v.detach().cpu() for k, v in get_model_state_dict(self.model, options=opts).items()},
            "steps": self.steps,
            "strategy": self.strategy,
        }
        if self.optimizer is not None:
            sd["optimizer"] = to_cpu(get_optimizer_state_dict(self.model, self.optimizer, options=opts))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a dict from `state_dict()` of a trainer under any strategy."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, sd["model"], options=opts)
        if self.optimizer is not None and sd.get("optimizer"):
            set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"], options=opts)
        self.steps = sd.get("steps", 0)

    def __repr__(self) -> str:
        return f"<mpnb.Trainer {self.strategy} dp={self.dp_rank}/{self.dp_size} steps={self.steps}>"


def to_cpu(x: Any) -> Any:
    """Detached CPU copies of the tensors in `x` (nested dicts, lists, tuples), for a state dict."""
    if torch.is_tensor(x):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x
