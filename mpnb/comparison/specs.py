"""The configs `mpnb.compare` runs, read from text like "ddp, zero stage=2, pipeline schedule=1f1b".

Each item is a strategy followed by settings (key=value, the `mpnb.Config`
field names or the short names in `ALIASES`), applied to the session's
config, so precision, batch sizes and the rest stay as set. Items may also be
dicts or `mpnb.Config`s. Every item is checked against the world size before
anything runs; a bad one raises `ConfigError` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.config import Config
from mpnb.planning.parallel_dims import Strategy

ALIASES = {"stage": "zero_stage", "stages": "pipeline_stages", "schedule": "pipeline_schedule",
           "tp": "tensor_parallel", "pp": "pipeline_stages"}
_SHORT_NAMES = {field: short for short, field in reversed(ALIASES.items())}  # labels: the first alias
_SHORT_ZERO = re.compile(r"^zero-?([0-3])$")  # "zero2", "zero-3"
EXAMPLE = "ddp, fsdp, zero stage=2, zero stage=3, tensor, pipeline schedule=1f1b"


@dataclass(frozen=True)
class ConfigSpec:
    """One column of the comparison: how the user wrote it, and the Config it means."""

    label: str
    config: Config


def parse_specs(items: str | Sequence[Any], base: Config, world_size: int,
                device_kind: str | None = None) -> list[ConfigSpec]:
    """The configs to compare, each validated for `world_size`; ConfigError names the first bad one."""
    if isinstance(items, str):
        items = [part for part in (p.strip() for p in items.split(",")) if part]
    items = list(items)
    if not items:
        raise ConfigError(f"Nothing to compare: list the configs, e.g. `%%compare {EXAMPLE}`.")
    specs = []
    for number, item in enumerate(items, 1):
        label, cfg = _read(item, base, world_size)
        problems = cfg.problems(world_size, device_kind)
        if problems:
            raise ConfigError(f"Config {number} ({label!r}) cannot run on {world_size} ranks: {problems[0]}")
        specs.append(ConfigSpec(label, cfg))
    labels = [s.label for s in specs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError(f"{twice[0]!r} is listed twice; give each config once.")
    return specs


def _read(item: Any, base: Config, world_size: int) -> tuple[str, Config]:
    if isinstance(item, Config):
        return item.summary(world_size), item
    if isinstance(item, dict):
        return _label(item), _apply(base, dict(item), world_size, repr(item))
    if not isinstance(item, str):
        raise ConfigError(f"A config to compare is a string like 'zero stage=2', a dict or an mpnb.Config; "
                          f"got {type(item).__name__}.")
    words = item.split()
    first = words[0].lower()
    changes: dict[str, Any] = {}
    short = _SHORT_ZERO.match(first)
    if short:
        changes.update(strategy="zero", zero_stage=int(short.group(1)))
    elif "=" in first:
        names = ", ".join(s.value for s in Strategy)
        raise ConfigError(f"{item!r}: start each config with its strategy ({names}), e.g. 'zero stage=2'.")
    else:
        changes["strategy"] = first
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item!r}: cannot read {word!r}; write settings as key=value, "
                              "e.g. 'zero stage=2'.")
        changes[ALIASES.get(key, key)] = value
    return " ".join(words), _apply(base, changes, world_size, repr(item))


def _apply(base: Config, changes: dict[str, Any], world_size: int, shown: str) -> Config:
    strategy = str(changes.get("strategy", base.strategy)).lower()
    # a model split with no degree given spans the world; a pipeline gets a micro-batch per stage
    if strategy == Strategy.TENSOR.value:
        changes.setdefault("tensor_parallel", world_size)
    if strategy == Strategy.PIPELINE.value:
        changes.setdefault("pipeline_stages", world_size)
        changes.setdefault("microbatches", changes["pipeline_stages"])
    try:
        return base.update(**changes)
    except ConfigError as exc:
        raise ConfigError(f"{shown}: {exc}") from None


def _label(changes: dict[str, Any]) -> str:
    """{"strategy": "zero", "zero_stage": 2} -> "zero stage=2", as the text form writes it."""
    rest = " ".join(f"{_SHORT_NAMES.get(k, k)}={v}" for k, v in changes.items() if k != "strategy")
    return f"{changes.get('strategy', '')} {rest}".strip()
