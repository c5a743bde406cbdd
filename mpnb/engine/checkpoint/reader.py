"""`trainer.load(path)`: fill a prepared trainer from a checkpoint written under any strategy and world size.

Each rank asks DCP for exactly the pieces it holds now (its FSDP shard, its
ZeRO partition, its pipeline stage's names), wherever they were written; DCP
reads the overlapping parts of the saved chunks. Before reading anything the
checkpoint's names and shapes are compared with the model's on every rank, so a
checkpoint of another model fails the same way everywhere, naming the first
differences, and the engines stay usable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mpnb.checkpoints import format as fmt
from mpnb.engine.checkpoint import rng
from mpnb.engine.checkpoint.collective import (
    agree,
    checkpoint_exception,
    distributed,
    failure_text,
    from_rank0,
    gather,
    rank,
    single_process_quiet,
    world,
)
from mpnb.engine.checkpoint.verified_reader import VerifiedFileReader
from mpnb.errors import CheckpointError


def load(trainer: Any, path: str | os.PathLike[str], *, optimizer: bool = True) -> dict[str, Any]:
    """Load model, optimizer state (unless `optimizer=False`), step, scheduler, RNG; returns the manifest."""
    trainer.wait_for_save()
    root = Path(from_rank0(str(Path(path).absolute())))
    manifest, error = None, None
    try:
        manifest = _complete_manifest(root)
    except CheckpointError as e:
        error = str(e)
    agree(error)
    assert manifest is not None
    reader = _reader(root, manifest)
    try:
        # the small files first: read beside the big ones, they waited behind them on the disk
        _check_other_files(root, manifest)  # before get_state_dict, which may initialize the optimizer
        if manifest["world_size"] == world():  # each rank then checks the tensor files it wrote
            reader.check_early([name for writer, name, _ in fmt.listed_files(manifest)
                                if writer == rank() and name.endswith(fmt.DCP_DATA_SUFFIX)])
        state = trainer.checkpoint_state()
        groups = state.get("optim", {}).pop("param_groups", [])
        if not optimizer or trainer.optimizer is None:
            state.pop("optim", None)
        _check_names_and_shapes(root, manifest, state, optimizer)
        _read_into(state, reader, root)
    finally:
        reader.close()
    if "optim" in state:
        _restore_hyperparameters(trainer.optimizer, groups, manifest["param_groups"])
        state["optim"]["param_groups"] = groups
    trainer.finish_checkpoint_load(state)
    _restore_extras(trainer, root, manifest, optimizer)
    trainer.steps = manifest["step"]
    return manifest


def _read_into(state: dict[str, Any], reader: VerifiedFileReader, root: Path) -> None:
    from torch.distributed.checkpoint import load as dcp_load

    try:
        with single_process_quiet():
            dcp_load(state, storage_reader=reader, no_dist=not distributed())
    except (Exception, checkpoint_exception()) as e:
        if damage := _raised_on_a_rank(e, CheckpointError):
            raise damage from None
        raise CheckpointError(
            f"Reading the checkpoint at {root} failed ({failure_text(e)}): a file is damaged or unreadable. "
            "Resume from an earlier checkpoint; the model was not changed where the read failed."
        ) from None


def _complete_manifest(root: Path) -> dict[str, Any]:
    manifest = fmt.read_manifest(root)
    problems = fmt.missing_or_short_files(root, manifest)
    if problems:
        raise CheckpointError(_damaged(root, problems))
    return manifest


def _check_other_files(root: Path, manifest: dict[str, Any]) -> None:
    """The checksums of the files besides DCP's tensor files (those are checked as they are read),
    split among the ranks; every rank raises the same error from the same gathered answers."""
    mine = [f for f in fmt.listed_files(manifest)
            if f[0] % world() == rank() and not f[1].endswith(fmt.DCP_DATA_SUFFIX)]
    problems = [p for part in gather(fmt.corrupted_files(root, mine)) for p in part]
    if problems:
        raise CheckpointError(_damaged(root, problems))


def _check_names_and_shapes(root: Path, manifest: dict[str, Any], state: dict[str, Any],
                            optimizer: bool) -> None:
    live: dict[str, list[int] | None] = {}
    for shapes in gather(_live_shapes(state)):  # a pipeline stage holds only its names: the whole model
        live.update(shapes)
    if mismatch := _mismatch(live, manifest, root, optimizer):  # the same verdict on every rank
        raise CheckpointError(mismatch)


def _reader(root: Path, manifest: dict[str, Any]) -> VerifiedFileReader:
    """DCP's reader that checks each tensor file's checksum as it reads it, before the model changes."""
    def agree_intact(problems: list[str]) -> None:
        found = sorted({p for part in gather(problems) for p in part})
        if found:
            raise CheckpointError(_damaged(root, found))

    files = {name: (writer, info) for writer, name, info in fmt.listed_files(manifest)}
    return VerifiedFileReader(root, files, agree_intact)


def _raised_on_a_rank(e: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` error among those DCP collected from the ranks (its CheckpointException)."""
    for failure in (getattr(e, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, kind):
            return exc
    return None


def _damaged(root: Path, problems: list[str]) -> str:
    return (f"The checkpoint at {root} is damaged: {fmt.first_few(problems)}. "
            "Resume from an earlier checkpoint.")


def flat_keys(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """DCP's flattened names ("model.fc1.weight") for the leaves of a nested state dict."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_keys(v, key + "."))
        else:
            out[key] = v
    return out


def _live_shapes(state: dict[str, Any]) -> dict[str, list[int] | None]:
    return {k: list(v.shape) if hasattr(v, "shape") else None for k, v in flat_keys(state).items()}


def _mismatch(live: dict[str, list[int] | None], manifest: dict[str, Any], root: Path,
              optimizer: bool) -> str | None:
    """Names or shapes the model (all ranks' names) has and the checkpoint lacks, or the other way."""
    saved = manifest["tensors"]
    model_saved = {k for k in saved if k.startswith(fmt.MODEL_PREFIX)}
    model_live = {k for k in live if k.startswith(fmt.MODEL_PREFIX)}
    problems = [f"{_short(k)} is not in the checkpoint" for k in sorted(model_live - model_saved)]
    problems += [f"the checkpoint's {_short(k)} is not in the model"
                 for k in sorted(model_saved - model_live)]
    for k in sorted(model_live & model_saved):
        if live[k] is not None and list(live[k]) != saved[k]["shape"]:
            problems.append(f"{_short(k)} is {tuple(saved[k]['shape'])} in the checkpoint, "
                            f"{tuple(live[k])} in the model")
    if problems:
        return (f"The checkpoint at {root} does not fit this model ({manifest['model_class']} was saved): "
                f"{fmt.first_few(problems)}. Build the same model as the one saved (same class "
                "and sizes) before loading.")
    if optimizer:
        missing = sorted(k for k in live if k.startswith(fmt.OPTIM_PREFIX) and k not in saved)
        if missing:
            return (f"The checkpoint at {root} has no optimizer state for {_short(missing[0])} "
                    f"({len(missing)} entries missing: another optimizer?). Use the optimizer it was saved "
                    "with, or load the weights only: trainer.load(path, optimizer=False).")
    return None


def _short(key: str) -> str:
    return key.removeprefix(fmt.MODEL_PREFIX)


def _restore_hyperparameters(optimizer: Any, groups: list[dict[str, Any]],
                             saved: list[dict[str, Any]]) -> None:
    """The learning rate and the rest as saved (a scheduler may have changed them), group by group."""
    if len(saved) != len(groups):
        return  # other grouping: keep the live optimizer's own settings
    live_groups = getattr(optimizer, "param_groups", [])
    for group, live, values in zip(groups, live_groups, saved, strict=False):
        for key, value in values.items():
            if key in group and isinstance(value, (int, float, list, bool)):
                restored = tuple(value) if isinstance(group[key], tuple) else value
                group[key] = restored
                live[key] = restored


def _restore_extras(trainer: Any, root: Path, manifest: dict[str, Any], optimizer: bool) -> None:
    me = rank()
    rng_path = root / fmt.rng_file(me)
    if manifest["world_size"] == world() and rng_path.is_file():  # other world sizes: ranks' streams differ
        rng.restore(torch.load(rng_path, weights_only=False))
    scheduler = getattr(trainer, "lr_scheduler", None)
    if optimizer and scheduler is not None and manifest.get("scheduler"):
        scheduler.load_state_dict(torch.load(root / fmt.SCHEDULER, weights_only=False))
