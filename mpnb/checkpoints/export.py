"""`export_checkpoint(checkpoint, out)`: a sharded checkpoint as weights plain torch or transformers loads.

One process, no process group: DCP reads every saved shard of each `model.*`
tensor into one full tensor (`torch.distributed.checkpoint.load(...,
no_dist=True)`, the documented way to load a checkpoint for local inference);
optimizer state is never read. What is written depends on `out`:

- `out` ends in `.safetensors`: one file, `model.load_state_dict(load_file(out))`
  works with strict=True (tied weights are kept, as separate copies);
- the model is a transformers model (the manifest has its config): a directory
  `save_pretrained` would write, config.json + model.safetensors without the tied
  weights, which `from_pretrained` ties again;
- otherwise: a directory with model.safetensors (tied weights kept).

A DeepSpeed checkpoint directory (engine.save_checkpoint's, with `latest` or
`global_step*/`) is converted the same way through DeepSpeed's zero_to_fp32.
Output is written to a hidden sibling and renamed into place, so `out` is
complete or absent. Kernel side: torch is imported only when an export runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

from mpnb.checkpoints.format import MANIFEST, MODEL_PREFIX, first_few, read_manifest
from mpnb.errors import CheckpointError

WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"


def export_checkpoint(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write `checkpoint`'s model weights to `out` (layouts: the module docstring); returns `out`."""
    src, target = Path(checkpoint).absolute(), Path(out).absolute()
    _check_target(src, target)
    if is_deepspeed_checkpoint(src):
        weights, tied, hf = _deepspeed_weights(src)
        model_class = None
    else:
        manifest = _complete_manifest(src)
        weights, tied = _dcp_weights(src, manifest), list(manifest.get("tied") or [])
        hf, model_class = manifest.get("hf_config"), manifest.get("model_class")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        if target.suffix == ".safetensors":
            _save(_unshared(weights), tmp)
            os.replace(tmp, target)
        else:
            tmp.mkdir()
            if hf:
                weights = {k: v for k, v in weights.items() if k not in set(tied)}
                config = _hf_config(hf, model_class)
                (tmp / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
            _save(_unshared(weights), tmp / WEIGHTS)
            _put_dir(tmp, target)
    except (OSError, _safetensors_error()) as e:  # a full disk is safetensors' "I/O error"
        raise CheckpointError(f"Writing the export to {target} failed ({e}). Free space or choose another "
                              "path; the checkpoint itself is unchanged.") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
    return target


def is_deepspeed_checkpoint(path: Path) -> bool:
    """A directory DeepSpeed's `engine.save_checkpoint` wrote (or one of its `global_step*` tags)."""
    if not path.is_dir() or (path / MANIFEST).exists():
        return False
    return ((path / "latest").is_file() or any(path.glob("global_step*/mp_rank_*_model_states.pt"))
            or any(path.glob("mp_rank_*_model_states.pt")))


# ---------------------------------------------------------------------- reading


def _complete_manifest(src: Path) -> dict[str, Any]:
    from mpnb.checkpoints.info import damaged_files

    manifest = read_manifest(src)
    problems = damaged_files(src, manifest, verify=True)  # a flipped byte would export silently otherwise
    if problems:
        raise CheckpointError(f"Cannot export {src}: the checkpoint is damaged ({first_few(problems)}). "
                              "Export an earlier checkpoint.")
    if not any(k.startswith(MODEL_PREFIX) for k in manifest.get("tensors", {})):
        raise CheckpointError(f"Cannot export {src}: its manifest lists no model weights. "
                              "Export a checkpoint trainer.save wrote.")
    return manifest


def _dcp_weights(src: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The full `model.*` tensors, read from every rank's shards into empty tensors of the saved shapes."""
    import torch
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    model = {
        key.removeprefix(MODEL_PREFIX): torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        for key, info in manifest["tensors"].items() if key.startswith(MODEL_PREFIX)
    }
    try:  # no_dist: this process reads alone, even where a process group exists (rank 0 of an export)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp_load({"model": model}, checkpoint_id=src, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"Reading the weights of {src} failed ({type(e).__name__}: {e}): a file is "
                              "damaged or unreadable. Export an earlier checkpoint.") from None
    return model


def _deepspeed_weights(src: Path) -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
    """DeepSpeed's fp32 weights, the names aliasing another weight, and a transformers config beside them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, tag = (src, None) if (src / "latest").is_file() else _tag(src)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints its progress
            weights = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    except Exception as e:
        raise CheckpointError(f"Converting the DeepSpeed checkpoint {src} failed ({type(e).__name__}: "
                              f"{e}). Pass the directory engine.save_checkpoint wrote, with all its files."
                              ) from None
    seen: set[int] = set()
    tied = []
    for name, t in weights.items():  # zero_to_fp32 returns a tied weight as the same tensor again
        if id(t) in seen:
            tied.append(name)
        seen.add(id(t))
    hf = None
    for folder in (root, root.parent):  # transformers' Trainer writes config.json beside global_step*/
        cfg = folder / HF_CONFIG
        if cfg.is_file():
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(cfg.read_text())
                hf = data if isinstance(data, dict) and "model_type" in data else None
            break
    return weights, tied, hf


def _tag(src: Path) -> tuple[Path, str]:
    """(checkpoint dir, tag) for a folder without `latest`: its newest global_step*, or the folder itself."""
    if any(src.glob("mp_rank_*_model_states.pt")):
        return src.parent, src.name
    steps = sorted(src.glob("global_step*"), key=lambda p: int("".join(filter(str.isdigit, p.name)) or 0))
    return src, steps[-1].name


# ---------------------------------------------------------------------- writing


def _check_target(src: Path, target: Path) -> None:
    if target == src or src in target.parents:
        raise CheckpointError(f"Cannot export {src} into itself ({target}). Choose a path outside it.")
    if target.suffix == ".safetensors":
        if target.is_dir():
            raise CheckpointError(f"{target} is a directory; an export ending in .safetensors is one file. "
                                  "Choose another name.")
        return
    if target.is_file():
        raise CheckpointError(f"{target} is a file; this export writes a directory (config.json + "
                              f"{WEIGHTS}). Choose another path, or end it in .safetensors for one file.")
    if target.is_dir() and any(target.iterdir()) and not (target / WEIGHTS).is_file():
        raise CheckpointError(f"{target} exists and is not an earlier export; exports replace only their own "
                              "directories. Choose a new path.")


def _unshared(weights: dict[str, Any]) -> dict[str, Any]:
    """Each tensor its own contiguous memory: safetensors refuses tensors that share storage."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.detach().clone().contiguous() if key in seen and t.numel() else t.detach().contiguous()
        seen.add(key)
    return out


def _safetensors_error() -> type[Exception]:
    from safetensors import SafetensorError

    return SafetensorError


def _save(weights: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(path), metadata={"format": "pt"})  # transformers checks the "format" entry
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _hf_config(hf: dict[str, Any], model_class: str | None) -> dict[str, Any]:
    config = dict(hf)
    if not config.get("architectures") and model_class:
        config["architectures"] = [model_class.rsplit(".", 1)[-1]]  # what save_pretrained records
    return config


def _put_dir(tmp: Path, target: Path) -> None:
    from mpnb.engine.checkpoint.atomic import fsync_dir, replace_dir

    fsync_dir(tmp)
    replace_dir(tmp, target)
