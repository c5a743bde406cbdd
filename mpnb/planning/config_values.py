"""Reading one `Config` setting from what people type: the allowed values, aliases and coercion.

`%mpnb config zero_stage=3`, a panel text box and a ds_config all hand over
strings (or numbers, lists, dicts); `coerce` turns each into the field's type
or raises ConfigError naming what is allowed. Combinations of settings are
checked in `config_checks`.
"""

from __future__ import annotations

import ast
import difflib
import typing
from enum import Enum
from typing import Any

from mpnb.errors import ConfigError
from mpnb.planning.parallel_dims import TENSOR_STYLES, Strategy

STRATEGIES = tuple(s.value for s in Strategy)
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("none", "optimizer", "parameters")

# Spellings people type that mean one of the allowed values.
ALIASES: dict[str, dict[str, str]] = {
    "precision": {"float32": "fp32", "32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "16": "fp16"},
    "strategy": {"deepspeed": "zero", "fsdp2": "fsdp", "pp": "pipeline", "tp": "tensor"},
    "offload": {"off": "none", "false": "none", "no": "none", "optim": "optimizer", "params": "parameters",
                "param": "parameters"},
    "pipeline_schedule": {"1F1B": "1f1b", "GPipe": "gpipe"},
}
# Settings that take one of a few names.
CHOICES: dict[str, tuple[str, ...]] = {
    "strategy": STRATEGIES,
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "precision": PRECISIONS,
    "offload": OFFLOADS,
}
_POSITIVE_INTS = (
    "pipeline_stages", "microbatches", "tensor_parallel", "micro_batch_size", "grad_accum_steps",
)
_TRUE = {"true", "1", "yes", "on", "y", "t"}
_FALSE = {"false", "0", "no", "off", "n", "f"}


def coerce(key: str, kind: Any, value: Any) -> Any:
    """Turn `value` into `kind`, the type of setting `key`, or raise ConfigError naming what is allowed."""
    origin = typing.get_origin(kind)
    if kind is bool:
        return _to_bool(key, value)
    if kind is int:
        out = _to_int(key, value)
        if key == "zero_stage" and out not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3 (got {out}).")
        if key in _POSITIVE_INTS and out < 1:
            raise ConfigError(f"{key} must be a positive integer (got {out}).")
        return out
    if isinstance(kind, type) and issubclass(kind, Enum):
        return kind(_to_choice(key, value))
    if kind is str:
        return _to_choice(key, value)
    if origin is list:
        return _to_list(key, value)
    if origin is dict:
        return _to_plan(key, value)
    return value  # pragma: no cover - every field type is handled above


def _to_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{key} must be true or false (got {value!r}).")


def _to_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer, got the boolean {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{key} must be an integer (got {value!r}).") from None


def _to_choice(key: str, value: Any) -> str:
    allowed = CHOICES[key]
    text = str(value).strip()
    text = ALIASES.get(key, {}).get(text, text)
    lowered = text.lower()
    lowered = ALIASES.get(key, {}).get(lowered, lowered)
    if lowered in allowed:
        return lowered
    hint = difflib.get_close_matches(lowered, allowed, n=1, cutoff=0.5)
    maybe = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ConfigError(f"{key} must be one of {', '.join(allowed)} (got {value!r}).{maybe}")


def _to_list(key: str, value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        text = str(value).strip()
        if text.startswith("["):
            try:
                items = list(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                raise ConfigError(f"{key}: cannot read {value!r}; write names separated by commas.") from None
        else:
            items = [part for part in text.split(",")]
    return [str(item).strip() for item in items if str(item).strip()]


def _to_plan(key: str, value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        items = list(value.items())
    else:
        text = str(value).strip()
        if text.startswith("{"):
            try:
                items = list(dict(ast.literal_eval(text)).items())
            except (ValueError, SyntaxError, TypeError):
                raise ConfigError(
                    f"{key}: cannot read {value!r}; write module:style pairs, "
                    "e.g. `mlp.fc:colwise,mlp.proj:rowwise`."
                ) from None
        else:
            items = []
            for part in filter(None, (p.strip() for p in text.split(","))):
                name, sep, style = part.partition(":")
                if not sep:
                    raise ConfigError(
                        f"{key}: {part!r} has no style; write module:style, e.g. `mlp.fc:colwise`."
                    )
                items.append((name, style))
    plan: dict[str, str] = {}
    for name, style in items:
        style_text = str(style).strip().lower()
        if style_text not in TENSOR_STYLES:
            raise ConfigError(
                f"{key}: style for {name!r} must be one of {', '.join(TENSOR_STYLES)} (got {style!r})."
            )
        plan[str(name).strip()] = style_text
    return plan
