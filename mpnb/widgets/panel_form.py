"""The config panel's form: one control per `Config` setting, and the way between the form and a Config.

Only the options of the chosen strategy are shown, and `pending_config` leaves
the hidden ones neutral, so switching strategies never carries a ZeRO stage
into a DDP config; switching back shows the earlier values again.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from mpnb.planning.config import Config
from mpnb.planning.config_values import PIPELINE_SCHEDULES
from mpnb.widgets.panel_plan import PlanInputs
from mpnb.widgets.panel_style import WIDE_LABELS
from mpnb.widgets.panel_support import StrategyGate

ZERO_STAGES = [
    ("0 · nothing sharded (data parallel through DeepSpeed)", 0),
    ("1 · shards the optimizer state", 1),
    ("2 · shards optimizer state + gradients", 2),
    ("3 · shards optimizer state + gradients + parameters", 3),
]
STRATEGY_OPTIONS = [("DDP", "ddp"), ("FSDP", "fsdp"), ("ZeRO", "zero"), ("Pipeline", "pipeline"),
                    ("Tensor", "tensor")]
STRATEGY_TIPS = [
    "DistributedDataParallel: every rank keeps the whole model",
    "FSDP2: parameters, gradients and optimizer state sharded",
    "DeepSpeed ZeRO stage 0-3",
    "split the layers into stages; microbatches flow through them",
    "split each layer's matrices across ranks (Megatron)",
]


def divisors_from_2(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


class StrategyForm(StrategyGate, PlanInputs):
    """The strategy, precision and batch controls of `ConfigPanel`, named after their Config fields."""

    config: Config  # the applied config; the form starts from it
    _updating: bool  # True while the form is set from code: no refresh per widget

    def _refresh(self, change: Any = None) -> None:
        """Redraw everything that follows the form; `ConfigPanel` defines it."""
        raise NotImplementedError

    def _build_form(self) -> None:
        self.strategy = widgets.ToggleButtons(options=STRATEGY_OPTIONS, tooltips=STRATEGY_TIPS,
                                              description="Strategy", style=WIDE_LABELS)
        self.strategy.add_class("mpnb-panel-strategy")
        self._build_support(STRATEGY_TIPS)  # before `_refresh` observes the strategy
        # max-content: at the default 300 px the labels wrap inside fixed-height rows and overlap
        self.zero_stage = widgets.RadioButtons(options=ZERO_STAGES, description="ZeRO stage",
                                               style=WIDE_LABELS, layout=widgets.Layout(width="max-content"))
        self.zero_stage.add_class("mpnb-panel-zero-stage")
        self.reshard_after_forward = widgets.Checkbox(
            description="reshard after forward (ZeRO-3 like; off = ZeRO-2 like, faster, more memory)",
            style=WIDE_LABELS, indent=False)
        self.fsdp_wrap = widgets.Text(description="FSDP units (class names)",
                                      placeholder="default: model blocks", style=WIDE_LABELS)
        self.pipeline_stages = widgets.Dropdown(description="Pipeline stages", style=WIDE_LABELS)
        self.pipeline_schedule = widgets.ToggleButtons(options=list(PIPELINE_SCHEDULES),
                                                       description="Schedule", style=WIDE_LABELS)
        self.microbatches = widgets.BoundedIntText(min=1, max=4096, description="Microbatches",
                                                   style=WIDE_LABELS)
        self.tensor_parallel = widgets.Dropdown(description="Tensor-parallel degree", style=WIDE_LABELS)
        self.precision = widgets.ToggleButtons(options=["fp32", "bf16", "fp16"], description="Precision",
                                               style=WIDE_LABELS)
        self.micro_batch_size = widgets.BoundedIntText(min=1, max=1_000_000, description="Micro batch size",
                                                       style=WIDE_LABELS)
        self.grad_accum_steps = widgets.BoundedIntText(min=1, max=100_000,
                                                       description="Gradient accumulation", style=WIDE_LABELS)
        self.activation_checkpointing = widgets.Checkbox(description="activation checkpointing", indent=False)
        self.offload = widgets.Dropdown(options=[("none", "none"), ("optimizer state to CPU", "optimizer"),
                                                 ("parameters + optimizer to CPU", "parameters")],
                                        description="Offload", style=WIDE_LABELS)
        self._zero_box = widgets.VBox([self.zero_stage])
        self._fsdp_box = widgets.VBox([self.reshard_after_forward, self.fsdp_wrap])
        self._pipeline_box = widgets.VBox([self.pipeline_stages, self.pipeline_schedule, self.microbatches])
        self._tensor_box = widgets.VBox([self.tensor_parallel])
        self._offload_box = widgets.VBox([self.offload])

    def _form_inputs(self) -> list[widgets.Widget]:
        return [
            self.strategy, self.zero_stage, self.reshard_after_forward, self.fsdp_wrap, self.pipeline_stages,
            self.pipeline_schedule, self.microbatches, self.tensor_parallel, self.precision,
            self.micro_batch_size, self.grad_accum_steps, self.activation_checkpointing, self.offload,
        ]

    def _set_degree_options(self, cfg: Config) -> None:
        world = self.world_size()
        stages = divisors_from_2(world)
        degrees = divisors_from_2(world)
        if cfg.pipeline_stages > 1 and cfg.pipeline_stages not in stages:
            stages = sorted({*stages, cfg.pipeline_stages})
        if cfg.tensor_parallel > 1 and cfg.tensor_parallel not in degrees:
            degrees = sorted({*degrees, cfg.tensor_parallel})
        self.pipeline_stages.options = stages
        self.tensor_parallel.options = degrees

    def _set_form(self, cfg: Config) -> None:
        """Show `cfg` in the form without triggering a refresh per widget."""
        self._updating = True
        try:
            self._set_degree_options(cfg)
            self.strategy.value = cfg.strategy
            self.zero_stage.value = cfg.zero_stage
            self.reshard_after_forward.value = cfg.reshard_after_forward
            self.fsdp_wrap.value = ", ".join(cfg.fsdp_wrap)
            if cfg.pipeline_stages > 1:
                self.pipeline_stages.value = cfg.pipeline_stages
            elif self.pipeline_stages.options:
                self.pipeline_stages.value = self.pipeline_stages.options[0]
            self.pipeline_schedule.value = cfg.pipeline_schedule
            if cfg.strategy == "pipeline":
                self.microbatches.value = cfg.microbatches
            elif self.pipeline_stages.value:
                self.microbatches.value = max(cfg.microbatches, 2 * int(self.pipeline_stages.value))
            if cfg.tensor_parallel > 1:
                self.tensor_parallel.value = cfg.tensor_parallel
            elif self.tensor_parallel.options:
                self.tensor_parallel.value = self.tensor_parallel.options[0]
            self.precision.value = cfg.precision
            self.micro_batch_size.value = cfg.micro_batch_size
            self.grad_accum_steps.value = cfg.grad_accum_steps
            self.activation_checkpointing.value = cfg.activation_checkpointing
            self.offload.value = cfg.offload
        finally:
            self._updating = False

    def pending_config(self) -> Config:
        """The Config the form shows now (not yet applied). Options hidden for this strategy are neutral."""
        s = self.strategy.value
        base = self.config
        values: dict[str, Any] = {
            "strategy": s,
            "zero_stage": self.zero_stage.value if s == "zero" else 0,
            "reshard_after_forward": self.reshard_after_forward.value,
            "fsdp_wrap": self.fsdp_wrap.value if s in ("fsdp", "tensor") else [],
            "pipeline_stages": (self.pipeline_stages.value or 1) if s == "pipeline" else 1,
            "pipeline_schedule": self.pipeline_schedule.value,
            "microbatches": self.microbatches.value if s == "pipeline" else 1,
            "pipeline_split_points": base.pipeline_split_points if s == "pipeline" else [],
            "tensor_parallel": (self.tensor_parallel.value or 1) if s == "tensor" else 1,
            "tensor_plan": base.tensor_plan if s == "tensor" else {},
            "precision": self.precision.value,
            "micro_batch_size": self.micro_batch_size.value,
            "grad_accum_steps": self.grad_accum_steps.value,
            "activation_checkpointing": self.activation_checkpointing.value,
            "offload": self.offload.value if s in ("zero", "fsdp") else "none",
        }
        if s == "pipeline" and values["pipeline_split_points"] and (
                len(values["pipeline_split_points"]) != values["pipeline_stages"] - 1):
            values["pipeline_split_points"] = []  # the stage count changed: split evenly instead
        return base.update(**values)

    def _update_visibility(self) -> None:
        s = self.strategy.value
        world = self.world_size()
        tp = self.tensor_parallel.value or 1
        show = {
            self._zero_box: s == "zero",
            self._fsdp_box: s == "fsdp" or (s == "tensor" and world // tp > 1),
            self._pipeline_box: s == "pipeline",
            self._tensor_box: s == "tensor",
            self._offload_box: s in ("zero", "fsdp"),
        }
        for box, visible in show.items():
            box.layout.display = "" if visible else "none"
        # offload choices that cannot work with the chosen stage are greyed out by validation; the
        # schedule's 1F1B needs microbatches >= stages, which the message explains
