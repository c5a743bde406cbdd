"""`mpnb.Config`: the one source of truth for how a model is parallelised.

The panel edits it, the magics read it, it travels to the engines as a plain
dict (`to_dict` / `from_dict`) and `mpnb.prepare` reads it there. This module
must not import torch: it is used in the notebook kernel.

The settings themselves, and how they combine, are in `mpnb.planning.settings`.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.codegen import config_code
from mpnb.planning.config_checks import DEVICE_KINDS, combination_problems, neutral_for, value_problems
from mpnb.planning.config_values import coerce, field_kinds, read_int
from mpnb.planning.ds_config import check_train_batch_size, ds_config_changes, parse_ds_config, to_ds_config
from mpnb.planning.parallel_dims import Strategy
from mpnb.planning.settings import Settings


@dataclass
class Config(Settings):
    """Every setting of a parallel training run, with editing, validation and conversions.

    The fields, and how they combine, are documented in `mpnb.planning.settings`:
    `strategy` picks the data-parallel flavour (ddp, fsdp, zero) or the model
    split (pipeline, tensor); `pipeline_stages` and `tensor_parallel` are the
    model-parallel degrees and the data-parallel degree is what remains of the
    world size (`data_parallel`).
    """

    # ------------------------------------------------------------------ plain data

    def to_dict(self) -> dict[str, Any]:
        """Plain data (strings, numbers, lists, dicts), as it travels to the engines."""
        return {**asdict(self), "strategy": str(self.strategy)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    # ------------------------------------------------------------------ editing

    def update(self, **changes: Any) -> Config:
        """A new Config with `changes` applied; unknown keys and bad values raise ConfigError.

        Values are coerced to the field's type, so strings from a magic line or a
        text box work too (``update(zero_stage="3")``). Changing `strategy` resets
        the settings that belonged only to the old one (zero_stage, pipeline and
        tensor degrees, offload, ...) unless the same update sets them.
        """
        coerced = {key: _coerce_field(key, value) for key, value in changes.items()}
        new_strategy = coerced.get("strategy", self.strategy)
        if new_strategy != self.strategy:
            # settings that only meant something for the old strategy go back to neutral,
            # unless this same update sets them (`%mpnb config strategy=ddp` just works)
            for key, value in neutral_for(new_strategy).items():
                coerced.setdefault(key, value)
        return replace(self, **coerced)

    def update_from_strings(self, assignments: list[str] | tuple[str, ...]) -> Config:
        """Apply ``["zero_stage=3", "strategy=zero"]`` (what `%mpnb config` receives)."""
        changes: dict[str, str] = {}
        for item in assignments:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(
                    f"Cannot read {item!r}: write settings as key=value, e.g. `zero_stage=3 strategy=zero`."
                )
            changes[key.strip()] = value.strip()
        return self.update(**changes)

    def diff(self, other: Config) -> dict[str, tuple[Any, Any]]:
        """{field: (value here, value in other)} for every field that differs."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }

    # ------------------------------------------------------------------ validation

    def problems(self, world_size: int, device_kind: str | None = None) -> list[str]:
        """Every reason this config cannot run on `world_size` ranks of `device_kind`.

        Each entry names the problem and the fix. `device_kind=None` skips the
        device checks (used when only the world size is known).
        """
        out = value_problems(self)
        if out:  # combination checks assume the values themselves are sane
            return out
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            return [f"world_size must be a positive integer, got {world_size!r}."]
        if device_kind is not None and device_kind not in DEVICE_KINDS:
            return [f"device_kind must be one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}."]
        out.extend(combination_problems(self, self.parallel_dims(world_size), device_kind))
        return out

    def validate(self, world_size: int, device_kind: str | None = None) -> Config:
        """Raise ConfigError with the first impossible setting; return self when it can run."""
        found = self.problems(world_size, device_kind)
        if found:
            raise ConfigError(found[0])
        return self

    # ------------------------------------------------------------------ DeepSpeed

    def to_deepspeed(self, world_size: int) -> dict[str, Any]:
        """The equivalent DeepSpeed `ds_config` dict.

        ddp maps to ZeRO stage 0 and fsdp to stage 3 (2 without resharding), the
        DeepSpeed settings that keep the same state per rank. Pipeline and
        tensor parallelism run through torch.distributed in mpnb and have no
        ds_config equivalent.
        """
        found = self.problems(world_size, None)
        if found:
            raise ConfigError(found[0])
        if self.strategy in (Strategy.PIPELINE, Strategy.TENSOR):
            api = "pipelining" if self.strategy == Strategy.PIPELINE else "tensor.parallel"
            raise ConfigError(
                f"strategy={self.strategy} runs through torch.distributed ({api}), not DeepSpeed, so "
                "there is no ds_config for it. Use `to_code()` to see what runs, or pick ddp, fsdp or zero."
            )
        return to_ds_config(self, world_size)

    @classmethod
    def from_deepspeed(cls, ds: dict[str, Any] | str, world_size: int | None = None) -> Config:
        """Read a ds_config (dict, JSON text) into a strategy=zero Config.

        Values of "auto" (Hugging Face style) keep mpnb's defaults. With
        `world_size`, a train_batch_size that disagrees with the other two sizes
        is an error, as it is in DeepSpeed. A malformed value raises ConfigError
        naming its ds_config key.
        """
        if world_size is not None:
            world_size = read_int("world_size", world_size)
        parsed = parse_ds_config(ds)
        cfg = cls().update(**ds_config_changes(parsed, world_size))
        check_train_batch_size(parsed, cfg, world_size)
        return cfg

    # ------------------------------------------------------------------ code

    def to_code(self, world_size: int, device_kind: str = "cuda") -> str:
        """The plain PyTorch / DeepSpeed code this config stands for, for learners."""
        found = self.problems(world_size, None)
        if found:
            raise ConfigError(found[0])
        return config_code(self, world_size, device_kind)


# ---------------------------------------------------------------------- helpers


def _coerce_field(key: str, value: Any) -> Any:
    """`value` as the type of field `key`; an unknown key raises ConfigError with the closest name."""
    kinds = field_kinds(Config)
    if key not in kinds:
        raise ConfigError(f"Unknown setting {key!r}.{_closest(key)}")
    return coerce(key, kinds[key], value)


def _closest(name: str) -> str:
    names = [f.name for f in fields(Config)]
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    if match:
        return f" Did you mean `{match[0]}`?"
    return f" Known settings: {', '.join(names)}."
