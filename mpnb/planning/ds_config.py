"""DeepSpeed's `ds_config` from `Settings` and back (`Config.to_deepspeed` / `Config.from_deepspeed`).

ddp maps to ZeRO stage 0 and fsdp to stage 3 (2 without resharding), the
DeepSpeed settings that keep the same state per rank. Reading a ds_config
gives strategy=zero; values of "auto" (Hugging Face style) keep mpnb's
defaults.
"""

from __future__ import annotations

import json
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.config_values import MAX_SETTING, coerce, field_kinds, read_int
from mpnb.planning.parallel_dims import Strategy
from mpnb.planning.settings import Settings

_TIMES = "\u00d7"  # the multiplication sign, spelled out for the linter
MAX_DS_CONFIG_CHARS = 1_000_000  # real ds_configs are a few hundred characters; this bounds parsing time


def to_ds_config(cfg: Settings, world_size: int) -> dict[str, Any]:
    """The ds_config for ddp, fsdp or zero settings (already validated for `world_size`)."""
    stage = cfg.zero_stage
    if cfg.strategy == Strategy.DDP:
        stage = 0
    elif cfg.strategy == Strategy.FSDP:
        stage = 3 if cfg.reshard_after_forward else 2
    zero: dict[str, Any] = {"stage": stage}
    if cfg.offload in ("optimizer", "parameters"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload == "parameters":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_batch_size": cfg.global_batch_size(world_size),
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16"},
        # mpnb passes the user's torch optimizer (e.g. torch.optim.AdamW) to deepspeed.initialize
        "zero_allow_untested_optimizer": True,
    }
    if cfg.precision == "fp16":
        ds["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
    if cfg.activation_checkpointing:
        ds["activation_checkpointing"] = {
            "partition_activations": False, "contiguous_memory_optimization": False,
        }
    return ds


def parse_ds_config(ds: dict[str, Any] | str) -> dict[str, Any]:
    """A ds_config as a dict, from a dict or JSON text; anything else raises ConfigError."""
    if isinstance(ds, str):
        if len(ds) > MAX_DS_CONFIG_CHARS:
            raise ConfigError(f"The ds_config is {len(ds):,} characters long; a ds_config is a few hundred. "
                              "Load the ds_config.json itself, not another file.")
        try:
            ds = json.loads(ds)
        except RecursionError:
            raise ConfigError("The ds_config is nested too deeply to be a ds_config; "
                              "load the ds_config.json itself.") from None
        except ValueError as exc:  # JSONDecodeError, and integers too long to convert
            raise ConfigError(
                f"The ds_config is not valid JSON ({exc}); fix the file and load it again."
            ) from None
    if not isinstance(ds, dict):
        raise ConfigError(f"A ds_config must be a JSON object (dict), got {type(ds).__name__}.")
    return ds


def ds_config_changes(ds: dict[str, Any], world_size: int | None) -> dict[str, Any]:
    """The `Config.update` changes a ds_config stands for (strategy=zero; "auto" keeps defaults).

    Every value mpnb reads is checked here, so a bad one names its ds_config key.
    """
    changes: dict[str, Any] = {"strategy": "zero"}
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError("ds_config 'zero_optimization' must be an object like {\"stage\": 2}.")
    if _given(zero.get("stage")):
        changes["zero_stage"] = _ds_setting("zero_optimization.stage", "zero_stage", zero["stage"])
    if _offloads(zero.get("offload_param")):
        changes["offload"] = "parameters"
    elif _offloads(zero.get("offload_optimizer")):
        changes["offload"] = "optimizer"
    else:
        changes["offload"] = "none"
    if _enabled(ds.get("bf16")) or _enabled(ds.get("bfloat16")):
        changes["precision"] = "bf16"
    elif _enabled(ds.get("fp16")):
        changes["precision"] = "fp16"
    else:
        changes["precision"] = "fp32"
    mb = _ds_size(ds, "train_micro_batch_size_per_gpu", "micro_batch_size")
    gas = _ds_size(ds, "gradient_accumulation_steps", "grad_accum_steps")
    tbs = _ds_size(ds, "train_batch_size")
    if mb is not None:
        changes["micro_batch_size"] = mb
    if gas is not None:
        changes["grad_accum_steps"] = gas
    if world_size and tbs is not None:
        if mb is not None and gas is None:
            changes["grad_accum_steps"] = max(1, tbs // (mb * world_size))
        elif gas is not None and mb is None:
            changes["micro_batch_size"] = max(1, tbs // (gas * world_size))
    if ds.get("activation_checkpointing"):
        changes["activation_checkpointing"] = True
    return changes


def check_train_batch_size(ds: dict[str, Any], cfg: Settings, world_size: int | None) -> None:
    """Raise ConfigError when train_batch_size disagrees with the other two sizes, as DeepSpeed does."""
    tbs = _ds_size(ds, "train_batch_size")
    if world_size and tbs is not None and cfg.global_batch_size(world_size) != tbs:
        raise ConfigError(
            f"ds_config train_batch_size={tbs} does not equal train_micro_batch_size_per_gpu "
            f"({cfg.micro_batch_size}) {_TIMES} gradient_accumulation_steps ({cfg.grad_accum_steps}) "
            f"{_TIMES} "
            f"{world_size} ranks = {cfg.global_batch_size(world_size)}. Fix one of the three."
        )


def _ds_size(ds: dict[str, Any], key: str, setting: str | None = None) -> int | None:
    """The positive int at `key`, or None when absent or "auto"; `setting` is the Config field it sets."""
    value = ds.get(key)
    if not _given(value):
        return None
    if setting is not None:
        return int(_ds_setting(key, setting, value))
    try:
        return read_int(key, value, maximum=MAX_SETTING)
    except ConfigError as exc:
        raise ConfigError(f"ds_config {key}: {exc} Fix it in the file and load it again.") from None


def _ds_setting(key: str, setting: str, value: Any) -> Any:
    """`value` read as Config field `setting`; a bad one raises ConfigError naming the ds_config `key`."""
    try:
        return coerce(setting, field_kinds(Settings)[setting], value)
    except ConfigError as exc:
        raise ConfigError(f"ds_config {key}: {exc} Fix it in the file and load it again.") from None


def _given(value: Any) -> bool:
    return value is not None and value != "auto"


def _enabled(section: Any) -> bool:
    if isinstance(section, dict):
        return section.get("enabled") is True or str(section.get("enabled")).lower() == "true"
    return False


def _offloads(section: Any) -> bool:
    return isinstance(section, dict) and str(section.get("device", "none")).lower() not in ("none", "")
