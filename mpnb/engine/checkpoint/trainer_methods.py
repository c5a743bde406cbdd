"""The Trainer's checkpoint methods: save, load and export sharded checkpoints (mpnb.engine.checkpoint).

A mixin, so a strategy's trainer overrides only where its state lives
(`checkpoint_state`, `finish_checkpoint_load`: ZeRO keeps it in DeepSpeed's
flat partitions) and every strategy saves, resumes and exports the same way.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from torch import nn


class TrainerCheckpoints:
    """Checkpoint methods of `mpnb.engine.trainer.Trainer` (which provides model, optimizer, steps)."""

    model: nn.Module
    optimizer: Any
    _last_save: Any = None  # the latest save (a background one may still be writing)

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's model inside the strategy's wrapper (DDP, DeepSpeed); a pipeline rank's stage module."""
        from torch.nn.parallel import DistributedDataParallel

        deepspeed = type(self.model).__name__ == "DeepSpeedEngine"  # not imported for a type check
        wrapped = deepspeed or isinstance(self.model, DistributedDataParallel)
        return self.model.module if wrapped else self.model

    def checkpoint_state(self) -> dict[str, Any]:
        """The live tensors a checkpoint saves and loads in place: `{"model": {fqn: t}, "optim": {...}}`.

        torch's `get_state_dict` names them as in the unwrapped model and keeps
        FSDP2/tensor-parallel shards as DTensors, so each rank writes only its shard.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def finish_checkpoint_load(self, state: dict[str, Any]) -> None:
        """Hand what DCP read into `checkpoint_state()`'s dicts to the model and optimizer.

        DCP reads into those dicts' tensors in place. Where they are the live parameters, buffers
        and optimizer state themselves (as `get_state_dict` returns them for DDP, FSDP2, tensor and
        pipeline parallel), the model and optimizer already hold what was read, and `set_state_dict`
        would copy every tensor onto itself (about 50 ms for 300 tensors); anything else goes through it.
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if not _holds_live_tensors(self.model, state["model"]):
            set_model_state_dict(self.model, state["model"])
        if "optim" in state and not _holds_live_optimizer_state(self.optimizer, state["optim"]):
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])

    def save(self, path: str | os.PathLike[str], *, blocking: bool = True) -> Any:
        """Write a sharded checkpoint to directory `path` (call on every rank); returns a `SaveHandle`.

        Each rank writes only what it holds; the directory appears complete or
        not at all. `blocking=False` returns at once and writes a CPU copy in the
        background while training goes on (`handle.wait()`; the next save waits). That copy's
        memory (one shard) stays with the trainer for the next background save to copy into.
        """
        from mpnb.engine.checkpoint.writer import save

        self._last_save = save(self, path, blocking=blocking)
        return self._last_save

    def wait_for_save(self) -> None:
        """Block until a background save has finished writing (raising its error, if it failed)."""
        if self._last_save is not None:
            self._last_save.wait()

    def load(self, path: str | os.PathLike[str], *, optimizer: bool = True) -> None:
        """Continue from a checkpoint written under any strategy and world size (call on every rank)."""
        from mpnb.engine.checkpoint.reader import load

        load(self, path, optimizer=optimizer)

    def export(self, path: str | os.PathLike[str]) -> None:
        """One consolidated file (`.safetensors`) or directory (transformers: `from_pretrained` reads it)."""
        from mpnb.engine.checkpoint.export import export

        export(self, path)


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return local.untyped_storage().data_ptr()


def _holds_live_tensors(model: nn.Module, model_state: dict[str, Any]) -> bool:
    """Whether every entry of `model_state` is (a view of) one of the model's parameters or buffers."""
    live = {_storage(t) for t in itertools.chain(model.parameters(), model.buffers())}
    return all(torch.is_tensor(v) and _storage(v) in live for v in model_state.values())


def _holds_live_optimizer_state(optimizer: Any, optim_state: dict[str, Any]) -> bool:
    """Whether each parameter's entry of `optim_state` is the optimizer's own state dict of that
    parameter (DCP then wrote into its tensors, and replaced its other values, in place)."""
    live = getattr(optimizer, "state", None)
    if not isinstance(live, dict):
        return False
    own = {id(per_param) for per_param in live.values()}
    return all(id(per_param) in own for per_param in optim_state.get("state", {}).values())
