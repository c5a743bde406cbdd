"""`mpnb.Config`: the one source of truth for how a model is parallelised.

The panel edits it, the magics read it, it travels to the engines as a plain
dict (`to_dict` / `from_dict`) and `mpnb.prepare` reads it there. This module
must not import torch: it is used in the notebook kernel.

How the settings combine (the order follows torchtitan: tensor, then pipeline,
then data parallel):

- `strategy` is one of ddp, fsdp, zero, pipeline, tensor.
- `pipeline_stages` (pp) and `tensor_parallel` (tp) are the model-parallel
  degrees; the data-parallel degree is what remains:
  ``data_parallel = world_size // (pipeline_stages * tensor_parallel)``.
- ddp, fsdp and zero are pure data parallelism: pp = tp = 1, every rank is a
  data-parallel rank. `zero_stage` (0-3) applies to strategy=zero only
  (DeepSpeed); FSDP2 is ZeRO-3 like with `reshard_after_forward=True` and
  ZeRO-2 like with False.
- strategy=pipeline needs pp >= 2. With pp < world_size each stage is
  sharded with FSDP2 over the data-parallel ranks of a 2-D (pp, dp) mesh
  (pipeline outermost; DDP around a stage miscounts gradients with several
  microbatches), so model states are ~1/(pp·dp) per rank. `micro_batch_size`
  is what one replica takes per step; the schedule splits it into
  `microbatches` equal chunks, so it must divide evenly and there must be at
  least as many microbatches as stages.
- strategy=tensor needs tp >= 2 (Megatron-style column/row sharding inside each
  block). With tp < world_size it composes with FSDP2 over the remaining ranks
  on a 2-D (dp, tp) mesh; tensor-parallel ranks share the same batch.
- `offload` (none, optimizer, parameters) is for zero and fsdp only. DeepSpeed:
  optimizer needs stage >= 1, parameters needs stage 3 and offloads the
  optimizer too. FSDP2's CPUOffloadPolicy moves parameters, gradients and the
  optimizer step together, so fsdp accepts offload=parameters only.
- The global batch is ``micro_batch_size * grad_accum_steps * data_parallel``.
"""

from __future__ import annotations

import ast
import difflib
import json
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from mpnb.errors import ConfigError

STRATEGIES = ("ddp", "fsdp", "zero", "pipeline", "tensor")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("none", "optimizer", "parameters")
TENSOR_STYLES = ("colwise", "rowwise")
DEVICE_KINDS = ("cpu", "cuda")

# Spellings people type that mean one of the allowed values.
_ALIASES: dict[str, dict[str, str]] = {
    "precision": {"float32": "fp32", "32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "16": "fp16"},
    "strategy": {"deepspeed": "zero", "fsdp2": "fsdp", "pp": "pipeline", "tp": "tensor"},
    "offload": {"off": "none", "false": "none", "no": "none", "optim": "optimizer", "params": "parameters",
                "param": "parameters"},
    "pipeline_schedule": {"1F1B": "1f1b", "GPipe": "gpipe"},
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "strategy": STRATEGIES,
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "precision": PRECISIONS,
    "offload": OFFLOADS,
}
_POSITIVE_INTS = (
    "pipeline_stages", "microbatches", "tensor_parallel", "micro_batch_size", "grad_accum_steps",
)
_TIMES = "\u00d7"  # the multiplication sign, spelled out for the linter
_TRUE = {"true", "1", "yes", "on", "y", "t"}
_FALSE = {"false", "0", "no", "off", "n", "f"}


@dataclass
class Config:
    """Every setting of a parallel training run.

    `strategy` picks the data-parallel flavour (ddp, fsdp, zero) or the model
    split (pipeline, tensor); `pipeline_stages` and `tensor_parallel` are the
    model-parallel degrees and the data-parallel degree is what remains of the
    world size (see `data_parallel`). The module docstring says how they combine.
    """

    strategy: str = "ddp"
    zero_stage: int = 0
    # FSDP2: free the unsharded parameters after forward (ZeRO-3 like) or keep them (ZeRO-2 like)
    reshard_after_forward: bool = True
    # FSDP2: module class names to shard as one unit each; empty = the model's repeated blocks
    fsdp_wrap: list[str] = field(default_factory=list)
    pipeline_stages: int = 1
    pipeline_schedule: str = "gpipe"
    microbatches: int = 1
    # pipeline: module names where a new stage starts; empty = split the sequential blocks evenly
    pipeline_split_points: list[str] = field(default_factory=list)
    tensor_parallel: int = 1
    # tensor: {module path: "colwise" | "rowwise"}; empty = the built-in plan for known layers
    tensor_plan: dict[str, str] = field(default_factory=dict)
    precision: str = "fp32"
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    activation_checkpointing: bool = False
    offload: str = "none"

    # ------------------------------------------------------------------ plain data

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        coerced = {key: _coerce(key, value) for key, value in changes.items()}
        new_strategy = coerced.get("strategy", self.strategy)
        if new_strategy != self.strategy:
            # settings that only meant something for the old strategy go back to neutral,
            # unless this same update sets them (`%mpnb config strategy=ddp` just works)
            for key, value in _neutral_for(new_strategy).items():
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

    # ------------------------------------------------------------------ derived sizes

    def model_parallel(self) -> int:
        return self.pipeline_stages * self.tensor_parallel

    def data_parallel(self, world_size: int) -> int:
        """Ranks that each see a different slice of the data."""
        return max(1, world_size // max(1, self.model_parallel()))

    def global_batch_size(self, world_size: int) -> int:
        """Samples per optimizer step across the whole cluster."""
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel(world_size)

    def summary(self, world_size: int | None = None) -> str:
        """One line for a status bar, e.g. ``ZeRO-2 · fp32 · mb 8 \u00d7 accum 1``."""
        if self.strategy == "zero":
            head = f"ZeRO-{self.zero_stage}"
        elif self.strategy == "fsdp":
            head = "FSDP" if self.reshard_after_forward else "FSDP (no reshard)"
        elif self.strategy == "pipeline":
            head = (f"Pipeline {self.pipeline_stages} stages "
                    f"({self.pipeline_schedule}, {self.microbatches} µb)")
        elif self.strategy == "tensor":
            head = f"TP {self.tensor_parallel}"
        else:
            head = self.strategy.upper()
        if world_size is not None and self.strategy in ("pipeline", "tensor"):
            dp = self.data_parallel(world_size)
            if dp > 1:
                head += f" {_TIMES} {'FSDP' if self.strategy == 'tensor' else 'DP'} {dp}"
        parts = [head, self.precision, f"mb {self.micro_batch_size} {_TIMES} accum {self.grad_accum_steps}"]
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return " · ".join(parts)

    # ------------------------------------------------------------------ validation

    def problems(self, world_size: int, device_kind: str | None = None) -> list[str]:
        """Every reason this config cannot run on `world_size` ranks of `device_kind`.

        Each entry names the problem and the fix. `device_kind=None` skips the
        device checks (used when only the world size is known).
        """
        out = _value_problems(self)
        if out:  # combination checks assume the values themselves are sane
            return out
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            return [f"world_size must be a positive integer, got {world_size!r}."]
        if device_kind is not None and device_kind not in DEVICE_KINDS:
            return [f"device_kind must be one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}."]
        out.extend(_combination_problems(self, world_size, device_kind))
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
        if self.strategy in ("pipeline", "tensor"):
            raise ConfigError(
                f"strategy={self.strategy} runs through torch.distributed "
                f"({'pipelining' if self.strategy == 'pipeline' else 'tensor.parallel'}), not DeepSpeed, so "
                "there is no ds_config for it. Use `to_code()` to see what runs, or pick ddp, fsdp or zero."
            )
        stage = self.zero_stage
        if self.strategy == "ddp":
            stage = 0
        elif self.strategy == "fsdp":
            stage = 3 if self.reshard_after_forward else 2
        zero: dict[str, Any] = {"stage": stage}
        if self.offload in ("optimizer", "parameters"):
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload == "parameters":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        ds: dict[str, Any] = {
            "train_batch_size": self.global_batch_size(world_size),
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum_steps,
            "zero_optimization": zero,
            "bf16": {"enabled": self.precision == "bf16"},
            "fp16": {"enabled": self.precision == "fp16"},
            # mpnb passes the user's torch optimizer (e.g. torch.optim.AdamW) to deepspeed.initialize
            "zero_allow_untested_optimizer": True,
        }
        if self.precision == "fp16":
            ds["fp16"].update({"loss_scale": 0, "initial_scale_power": 16})
        if self.activation_checkpointing:
            ds["activation_checkpointing"] = {
                "partition_activations": False, "contiguous_memory_optimization": False,
            }
        return ds

    @classmethod
    def from_deepspeed(cls, ds: dict[str, Any] | str, world_size: int | None = None) -> Config:
        """Read a ds_config (dict, JSON text) into a strategy=zero Config.

        Values of "auto" (Hugging Face style) keep mpnb's defaults. With
        `world_size`, a train_batch_size that disagrees with the other two sizes
        is an error, as it is in DeepSpeed.
        """
        if isinstance(ds, str):
            try:
                ds = json.loads(ds)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"The ds_config is not valid JSON ({exc}); fix the file and load it again."
                ) from exc
        if not isinstance(ds, dict):
            raise ConfigError(f"A ds_config must be a JSON object (dict), got {type(ds).__name__}.")
        changes: dict[str, Any] = {"strategy": "zero"}
        zero = ds.get("zero_optimization") or {}
        if not isinstance(zero, dict):
            raise ConfigError("ds_config 'zero_optimization' must be an object like {\"stage\": 2}.")
        if _given(zero.get("stage")):
            changes["zero_stage"] = zero["stage"]
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
        mb = ds.get("train_micro_batch_size_per_gpu")
        gas = ds.get("gradient_accumulation_steps")
        tbs = ds.get("train_batch_size")
        if _given(mb):
            changes["micro_batch_size"] = mb
        if _given(gas):
            changes["grad_accum_steps"] = gas
        if world_size and _given(tbs):
            if _given(mb) and not _given(gas):
                changes["grad_accum_steps"] = max(1, int(tbs) // (int(mb) * world_size))
            elif _given(gas) and not _given(mb):
                changes["micro_batch_size"] = max(1, int(tbs) // (int(gas) * world_size))
        if ds.get("activation_checkpointing"):
            changes["activation_checkpointing"] = True
        cfg = cls().update(**changes)
        if world_size and _given(tbs) and cfg.global_batch_size(world_size) != int(tbs):
            raise ConfigError(
                f"ds_config train_batch_size={tbs} does not equal train_micro_batch_size_per_gpu "
                f"({cfg.micro_batch_size}) {_TIMES} gradient_accumulation_steps ({cfg.grad_accum_steps}) "
                f"{_TIMES} "
                f"{world_size} ranks = {cfg.global_batch_size(world_size)}. Fix one of the three."
            )
        return cfg

    # ------------------------------------------------------------------ code

    def to_code(self, world_size: int, device_kind: str = "cuda") -> str:
        """The plain PyTorch / DeepSpeed code this config stands for, for learners."""
        from mpnb.planning.codegen import config_code  # kept apart: long string templates

        found = self.problems(world_size, None)
        if found:
            raise ConfigError(found[0])
        return config_code(self, world_size, device_kind)


# ---------------------------------------------------------------------- helpers


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _closest(name: str) -> str:
    names = [f.name for f in fields(Config)]
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    if match:
        return f" Did you mean `{match[0]}`?"
    return f" Known settings: {', '.join(names)}."


def _coerce(key: str, value: Any) -> Any:
    """Turn `value` into the type of field `key`, or raise ConfigError naming what is allowed."""
    types = _field_types()
    if key not in types:
        raise ConfigError(f"Unknown setting {key!r}.{_closest(key)}")
    kind = types[key]
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
    allowed = _CHOICES[key]
    text = str(value).strip()
    text = _ALIASES.get(key, {}).get(text, text)
    lowered = text.lower()
    lowered = _ALIASES.get(key, {}).get(lowered, lowered)
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
    out = [str(item).strip() for item in items if str(item).strip()]
    return out


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


def _value_problems(cfg: Config) -> list[str]:
    """Values that are wrong on their own, whatever the world size (e.g. after direct construction)."""
    out: list[str] = []
    for f in fields(cfg):
        try:
            coerced = _coerce(f.name, getattr(cfg, f.name))
        except ConfigError as exc:
            out.append(str(exc))
            continue
        if coerced != getattr(cfg, f.name) and f.name in _CHOICES:
            out.append(f"{f.name}={getattr(cfg, f.name)!r} is not written as mpnb expects; use {coerced!r}.")
    return out


def _combination_problems(cfg: Config, world: int, device: str | None) -> list[str]:
    out: list[str] = []
    s, pp, tp = cfg.strategy, cfg.pipeline_stages, cfg.tensor_parallel

    if device == "cpu" and cfg.precision == "fp16":
        out.append("fp16 is not supported on CPU (neither torch nor DeepSpeed train in fp16 there). "
                   "Use precision=bf16 or fp32.")

    # zero_stage belongs to DeepSpeed
    if s == "pipeline" and cfg.zero_stage == 3:
        out.append("ZeRO-3 cannot be combined with pipeline stages: it shards every layer's parameters "
                   "across ranks that hold different stages. Use zero_stage=0 with strategy=pipeline.")
    elif s == "zero" and pp > 1:
        if cfg.zero_stage >= 2:
            out.append(f"ZeRO-{cfg.zero_stage} cannot be combined with pipeline stages (it shards gradients"
                       f"{' and parameters' if cfg.zero_stage == 3 else ''} that each stage accumulates over "
                       "microbatches). Set pipeline_stages=1, or use strategy=pipeline.")
        else:
            out.append("strategy=zero does not split the model into pipeline stages in mpnb. "
                       "Set pipeline_stages=1, or use strategy=pipeline (stages replicated data-parallel).")
    elif s != "zero" and cfg.zero_stage != 0:
        out.append(f"zero_stage={cfg.zero_stage} applies only to strategy=zero (DeepSpeed); "
                   f"set strategy=zero, or zero_stage=0 to use {s}.")

    # model-parallel degrees belong to their strategy
    if s in ("pipeline", "tensor") and world < 2:
        out.append(f"strategy={s} splits the model across ranks and needs at least 2; this world has "
                   f"{world}. Start more ranks, or use ddp.")
    elif s == "pipeline":
        if pp < 2:
            out.append(f"strategy=pipeline needs pipeline_stages >= 2 (got {pp}); "
                       f"set pipeline_stages to a divisor of the world size {world}, e.g. 2.")
    elif pp > 1 and s != "zero":
        out.append(f"pipeline_stages={pp} applies only to strategy=pipeline; "
                   "set strategy=pipeline or pipeline_stages=1.")
    if s == "tensor" and world >= 2:
        if tp < 2:
            out.append(f"strategy=tensor needs tensor_parallel >= 2 (got {tp}); "
                       f"set tensor_parallel to a divisor of the world size {world}, e.g. 2.")
    elif tp > 1:
        out.append(f"tensor_parallel={tp} applies only to strategy=tensor; "
                   "set strategy=tensor or tensor_parallel=1.")
    if pp > 1 and tp > 1:
        out.append("Pipeline and tensor parallelism together are not supported yet; choose one of them.")

    # degrees must tile the world
    if pp > world:
        out.append(f"pipeline_stages={pp} is more than the {world} ranks; "
                   "each stage needs at least one rank.")
    elif world % pp:
        out.append(f"pipeline_stages={pp} does not divide the world size {world}; "
                   f"use one of {_divisors(world)}.")
    if tp > world:
        out.append(f"tensor_parallel={tp} is more than the {world} ranks.")
    elif world % tp:
        out.append(f"tensor_parallel={tp} does not divide the world size {world}; "
                   f"use one of {_divisors(world)}.")

    # pipeline schedule
    if s == "pipeline":
        if cfg.microbatches < pp:
            out.append(f"microbatches={cfg.microbatches} is fewer than the {pp} pipeline stages, so stages "
                       f"would idle; set microbatches >= {pp} (e.g. {2 * pp}).")
        if cfg.micro_batch_size % cfg.microbatches:
            out.append(f"micro_batch_size={cfg.micro_batch_size} does not split into "
                       f"{cfg.microbatches} equal microbatches; make micro_batch_size a multiple of "
                       "microbatches.")
        if cfg.grad_accum_steps != 1:
            out.append(f"grad_accum_steps={cfg.grad_accum_steps} does not apply to strategy=pipeline: the "
                       "schedule already accumulates gradients over its microbatches. Set grad_accum_steps=1 "
                       "and raise microbatches (or micro_batch_size) instead.")
    elif cfg.microbatches != 1:
        out.append(f"microbatches={cfg.microbatches} applies only to strategy=pipeline; set microbatches=1 "
                   "(use grad_accum_steps to accumulate gradients).")
    if cfg.pipeline_split_points:
        if s != "pipeline":
            out.append("pipeline_split_points applies only to strategy=pipeline; "
                       "clear it or set strategy=pipeline.")
        elif len(cfg.pipeline_split_points) != pp - 1:
            out.append(f"{pp} pipeline stages need {pp - 1} split points, got "
                       f"{len(cfg.pipeline_split_points)} ({', '.join(cfg.pipeline_split_points)}).")
    if cfg.tensor_plan and s != "tensor":
        out.append("tensor_plan applies only to strategy=tensor; clear it or set strategy=tensor.")
    if cfg.fsdp_wrap and s not in ("fsdp", "tensor"):
        out.append("fsdp_wrap applies only to strategy=fsdp (or tensor, which shards with FSDP2 across "
                   "data-parallel ranks); clear it.")

    # offload
    if cfg.offload != "none":
        if s not in ("zero", "fsdp"):
            out.append(f"offload={cfg.offload} needs strategy=zero (DeepSpeed) or fsdp; {s} keeps "
                       "everything on the device. Set offload=none or change strategy.")
        elif s == "zero" and cfg.offload == "optimizer" and cfg.zero_stage == 0:
            out.append("offload=optimizer needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads the optimizer "
                       "partition); set zero_stage >= 1.")
        elif s == "zero" and cfg.offload == "parameters" and cfg.zero_stage != 3:
            out.append("offload=parameters needs ZeRO stage 3 (only stage 3 partitions parameters); "
                       "set zero_stage=3 or offload=optimizer.")
        elif s == "fsdp" and cfg.offload == "optimizer":
            out.append("FSDP2 offloads parameters, gradients and the optimizer step together "
                       "(CPUOffloadPolicy); use offload=parameters with strategy=fsdp, or strategy=zero "
                       "for optimizer-only offload.")
        elif s == "fsdp" and cfg.offload == "parameters" and device == "cpu":
            out.append("offload=parameters with strategy=fsdp needs an accelerator: FSDP2's CPUOffloadPolicy "
                       "moves shards from the GPU to host memory, and CPU ranks have nothing to offload. "
                       "Use strategy=zero with zero_stage=3 and offload=parameters (works on CPU), or "
                       "offload=none.")
    return out


def _neutral_for(strategy: str) -> dict[str, Any]:
    """The values of settings that do not apply to `strategy` (what validate accepts)."""
    out: dict[str, Any] = {}
    if strategy != "zero":
        out["zero_stage"] = 0
    if strategy != "pipeline":
        out.update(pipeline_stages=1, microbatches=1, pipeline_split_points=[])
    if strategy != "tensor":
        out.update(tensor_parallel=1, tensor_plan={})
    if strategy not in ("zero", "fsdp"):
        out["offload"] = "none"
    if strategy not in ("fsdp", "tensor"):
        out["fsdp_wrap"] = []
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _given(value: Any) -> bool:
    return value is not None and value != "auto"


def _enabled(section: Any) -> bool:
    if isinstance(section, dict):
        return section.get("enabled") is True or str(section.get("enabled")).lower() == "true"
    return False


def _offloads(section: Any) -> bool:
    return isinstance(section, dict) and str(section.get("device", "none")).lower() not in ("none", "")
