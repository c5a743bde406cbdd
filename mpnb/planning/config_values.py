"""Reading one `Config` setting from what people type: the allowed values, aliases and coercion.

`%mpnb config zero_stage=3`, a panel text box and a ds_config all hand over
strings (or numbers, lists, dicts); `coerce` turns each into the field's type
or raises ConfigError naming what is allowed. Combinations of settings are
checked in `config_checks`.
"""

from __future__ import annotations

import ast
import difflib
import functools
import math
import numbers
import reprlib
import typing
from dataclasses import fields
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
# sizes beyond int32 are typos (or hostile files), and keep the estimator's arithmetic finite
MAX_SETTING = 2**31 - 1
# what a malformed literal makes ast.literal_eval raise (deep nesting: RecursionError or SyntaxError)
_LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)
_TRUE = {"true", "1", "yes", "on", "y", "t"}
_FALSE = {"false", "0", "no", "off", "n", "f"}


def coerce(key: str, kind: Any, value: Any) -> Any:
    """Turn `value` into `kind`, the type of setting `key`, or raise ConfigError naming what is allowed."""
    origin = typing.get_origin(kind)
    if kind is bool:
        return _to_bool(key, value)
    if kind is int:
        out = read_int(key, value, minimum=None)
        if key == "zero_stage" and out not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3 (got {shown(out)}).")
        if key in _POSITIVE_INTS:
            return read_int(key, out, maximum=MAX_SETTING)
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
    raise ConfigError(f"{key} must be true or false (got {shown(value)}).")


@functools.cache
def field_kinds(cls: type) -> dict[str, Any]:
    """{field name: type} of a Settings dataclass; cached, as resolving the hints costs ~0.2 ms."""
    return typing.get_type_hints(cls)


def normalize(settings: Any) -> None:
    """Store each field of `settings` in its type where the value means one thing ("8", 8.0, "BF16").

    Values `coerce` cannot read stay as given, for `Config.problems` to name.
    """
    kinds = field_kinds(type(settings))
    for f in fields(settings):
        value = getattr(settings, f.name)
        kind = kinds[f.name]
        if type(value) is kind and (kind is not str or value in CHOICES[f.name]):
            continue  # already stored in its type (ranges are for `problems`); keeps Config() cheap
        try:
            coerced = coerce(f.name, kind, value)
        except ConfigError:
            continue
        if coerced != value or type(coerced) is not type(value):
            setattr(settings, f.name, coerced)


def shown(value: Any) -> str:
    """`repr(value)` cut to a readable length (a bad value can be a megabyte of text)."""
    return reprlib.repr(value)


def read_int(name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None) -> int:
    """`value` as an int, in the forms people write one: 8, "8", 8.0, 7.5e9, "7.5e9".

    Refused with a ConfigError naming `name`: booleans, lists and other non-numbers, NaN
    and infinities, fractions, and values outside [minimum, maximum].
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got the boolean {value!r}; write a number such as 8.")
    number: Any = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise ConfigError(f"{name} must be an integer (got {shown(value)}); write a number "
                                  "such as 8.") from None
    if isinstance(number, numbers.Integral):
        out = int(number)
    elif isinstance(number, numbers.Real):
        real = float(number)
        if not math.isfinite(real):
            raise ConfigError(f"{name} must be a finite integer (got {shown(value)}); "
                              "write a number such as 8.")
        if not real.is_integer():
            raise ConfigError(f"{name} must be an integer (got {shown(value)}); write a whole number.")
        out = int(real)
    else:
        raise ConfigError(f"{name} must be an integer (got {type(value).__name__} {shown(value)}); "
                          "write a number such as 8.")
    if minimum is not None and out < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{name} must be {kind} (got {shown(out)}).")
    if maximum is not None and out > maximum:
        raise ConfigError(f"{name} must be at most {maximum} (got {shown(out)}); check for a typo.")
    return out


def _to_choice(key: str, value: Any) -> str:
    allowed = CHOICES[key]
    text = value.strip() if isinstance(value, str) else str(value)
    text = ALIASES.get(key, {}).get(text, text)
    lowered = text.lower()
    lowered = ALIASES.get(key, {}).get(lowered, lowered)
    if lowered in allowed:
        return lowered
    hint = difflib.get_close_matches(lowered, allowed, n=1, cutoff=0.5)
    maybe = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ConfigError(f"{key} must be one of {', '.join(allowed)} (got {shown(value)}).{maybe}")


def _to_list(key: str, value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                items = list(ast.literal_eval(text))
            except _LITERAL_ERRORS:
                raise ConfigError(
                    f"{key}: cannot read {shown(value)}; write names separated by commas."
                ) from None
        else:
            items = [part for part in text.split(",")]
    else:
        raise ConfigError(f"{key} must be a list of names (got {type(value).__name__} {shown(value)}); "
                          "write names separated by commas, e.g. `Block,MLP`.")
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{key} must hold names as text (got {type(item).__name__} {shown(item)}); "
                              "write e.g. `Block,MLP`.")
    return [item.strip() for item in items if item.strip()]


def _to_plan(key: str, value: Any) -> dict[str, str]:
    if isinstance(value, dict):
        items = list(value.items())
    elif not isinstance(value, str):
        raise ConfigError(f"{key} must map module names to styles (got {type(value).__name__} "
                          f"{shown(value)}); write module:style pairs, e.g. `mlp.fc:colwise`.")
    else:
        text = value.strip()
        if text.startswith("{"):
            try:
                items = list(dict(ast.literal_eval(text)).items())
            except _LITERAL_ERRORS:
                raise ConfigError(
                    f"{key}: cannot read {shown(value)}; write module:style pairs, "
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
        style_text = style.strip().lower() if isinstance(style, str) else ""
        if style_text not in TENSOR_STYLES:
            raise ConfigError(
                f"{key}: style for {shown(name)} must be one of {', '.join(TENSOR_STYLES)} "
                f"(got {shown(style)})."
            )
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{key}: module names must be non-empty text (got {shown(name)}); "
                              "write e.g. `mlp.fc:colwise`.")
        plan[str(name).strip()] = style_text
    return plan
