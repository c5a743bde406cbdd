"""`mpnb.config_panel()`: choose a strategy, see what each rank will hold, apply it.

The panel edits the live session's `mpnb.Config` (or a standalone one when no
cluster runs, with a world size to plan for). Every change re-validates the
form with `Config.problems` and re-runs `mpnb.estimate`, so the bars and the
message follow the form at once; Apply pushes the config to every engine
through `Session.set_config`, and `Session.on_change` brings changes made
elsewhere (`%mpnb config zero_stage=3`) back into an open panel.

Stable CSS classes for browser tests and styling: `mpnb-panel` (root),
`mpnb-panel-form`, `mpnb-panel-strategy`, `mpnb-panel-zero-stage`,
`mpnb-panel-apply`, `mpnb-panel-message`, `mpnb-panel-summary`,
`mpnb-panel-changes`, `mpnb-panel-estimate`, `mpnb-panel-compare`,
`mpnb-panel-export`, `mpnb-panel-import`, `mpnb-panel-lr`, `mpnb-panel-capacity-input`,
and inside the bars (see `mpnb.widgets.bars`) `mpnb-panel-row` (data-rank or
data-strategy, data-total, data-fits), `mpnb-panel-bar`, `mpnb-panel-seg-<category>`
(data-bytes), `mpnb-panel-capacity`, `mpnb-panel-warning`.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import re
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from mpnb.errors import ConfigError, MpnbError
from mpnb.planning.config import PIPELINE_SCHEDULES, Config
from mpnb.planning.estimator import Estimate, estimate
from mpnb.widgets.bars import compare_html, estimate_html

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
COMPARE = [
    ("DDP", {"strategy": "ddp"}),
    ("ZeRO-1", {"strategy": "zero", "zero_stage": 1}),
    ("ZeRO-2", {"strategy": "zero", "zero_stage": 2}),
    ("ZeRO-3", {"strategy": "zero", "zero_stage": 3}),
    ("FSDP", {"strategy": "fsdp"}),
]
_TIMES = "\u00d7"  # the multiplication sign, spelled out for the linter
_ERROR = '<div class="mpnb-panel-error" style="color:#c44e52">{}</div>'
DEFAULT_CAPACITY_GB = 80.0  # an A100/H100 80 GB, for planning without a cluster
_WIDE = {"description_width": "initial"}


def config_panel(model: Any = None, *, world_size: int | None = None, device_kind: str | None = None,
                 capacity_gb: float | None = None, learning_rate: float | None = None) -> ConfigPanel:
    """Open the config panel for the live session (or standalone, planning for `world_size` ranks).

    `model` is an nn.Module or a parameter count; without one the panel asks
    for the size and shape (default: GPT-2 small).
    """
    return ConfigPanel(model, world_size=world_size, device_kind=device_kind, capacity_gb=capacity_gb,
                       learning_rate=learning_rate)


def parse_count(text: str) -> int:
    """'124M', '7.5B', '1e9', '350,000' -> an int; ConfigError otherwise."""
    cleaned = str(text).strip().replace(",", "").replace("_", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)", cleaned)
    if not match:
        raise ConfigError(f"Cannot read the parameter count {text!r}; write e.g. 124M, 7.5B or 1e9.")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def _default_capacity_gb(device_kind: str) -> float:
    """CPU ranks share the machine's memory (the monitor reports it as capacity); GPUs: an 80 GB card."""
    if device_kind == "cpu":
        import psutil

        return psutil.virtual_memory().total / 1e9
    return DEFAULT_CAPACITY_GB


def _divisors_from_2(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _current_session() -> Any | None:
    from mpnb.cluster import session as cluster

    return cluster.current()


class ConfigPanel(widgets.VBox):
    """The widget `config_panel()` returns; attributes named after Config fields are its controls."""

    def __init__(self, model: Any = None, *, world_size: int | None = None, device_kind: str | None = None,
                 capacity_gb: float | None = None, learning_rate: float | None = None) -> None:
        super().__init__()
        self.add_class("mpnb-panel")
        self._model = model
        self._session = _current_session()
        self._updating = False
        self._applying = False
        self._unsubscribe: Any = None
        self._batch_change: tuple[int, int] | None = None
        self._applied_note = ""
        self.config: Config = self._session.config if self._session is not None else Config()
        self.last_estimate: Estimate | None = None

        self._build_form()
        self._build_cluster(world_size, device_kind, capacity_gb)
        self._build_model()
        self._build_outputs(learning_rate)
        self._layout()
        self._set_form(self.config)
        for w in self._inputs():
            w.observe(self._refresh, names="value")
        self.lr.observe(lambda _: self._show_changes(), names="value")
        self.upload.observe(self._on_upload, names="value")
        self.apply_button.on_click(self._on_apply)
        self.load_button.on_click(self._on_load_path)
        self.save_ds_button.on_click(lambda _: self._save(self.ds_path.value, self.ds_text.value))
        self.save_code_button.on_click(lambda _: self._save(self.code_path.value, self.code_text.value))
        # listen to every session, so a cluster started after the panel opened is picked up too
        from mpnb.cluster import session as cluster

        self._unsubscribe = cluster.on_change(self._on_session_change)
        self._refresh()

    # ------------------------------------------------------------------ building

    def _build_form(self) -> None:
        self.strategy = widgets.ToggleButtons(options=STRATEGY_OPTIONS, tooltips=STRATEGY_TIPS,
                                              description="Strategy", style=_WIDE)
        self.strategy.add_class("mpnb-panel-strategy")
        # max-content: at the default 300 px the labels wrap inside fixed-height rows and overlap
        self.zero_stage = widgets.RadioButtons(options=ZERO_STAGES, description="ZeRO stage", style=_WIDE,
                                               layout=widgets.Layout(width="max-content"))
        self.zero_stage.add_class("mpnb-panel-zero-stage")
        self.reshard_after_forward = widgets.Checkbox(
            description="reshard after forward (ZeRO-3 like; off = ZeRO-2 like, faster, more memory)",
            style=_WIDE, indent=False)
        self.fsdp_wrap = widgets.Text(description="FSDP units (class names)",
                                      placeholder="default: model blocks", style=_WIDE)
        self.pipeline_stages = widgets.Dropdown(description="Pipeline stages", style=_WIDE)
        self.pipeline_schedule = widgets.ToggleButtons(options=list(PIPELINE_SCHEDULES),
                                                       description="Schedule", style=_WIDE)
        self.microbatches = widgets.BoundedIntText(min=1, max=4096, description="Microbatches", style=_WIDE)
        self.tensor_parallel = widgets.Dropdown(description="Tensor-parallel degree", style=_WIDE)
        self.precision = widgets.ToggleButtons(options=["fp32", "bf16", "fp16"], description="Precision",
                                               style=_WIDE)
        self.micro_batch_size = widgets.BoundedIntText(min=1, max=1_000_000, description="Micro batch size",
                                                       style=_WIDE)
        self.grad_accum_steps = widgets.BoundedIntText(min=1, max=100_000,
                                                       description="Gradient accumulation", style=_WIDE)
        self.activation_checkpointing = widgets.Checkbox(description="activation checkpointing", indent=False)
        self.offload = widgets.Dropdown(options=[("none", "none"), ("optimizer state to CPU", "optimizer"),
                                                 ("parameters + optimizer to CPU", "parameters")],
                                        description="Offload", style=_WIDE)
        self._zero_box = widgets.VBox([self.zero_stage])
        self._fsdp_box = widgets.VBox([self.reshard_after_forward, self.fsdp_wrap])
        self._pipeline_box = widgets.VBox([self.pipeline_stages, self.pipeline_schedule, self.microbatches])
        self._tensor_box = widgets.VBox([self.tensor_parallel])
        self._offload_box = widgets.VBox([self.offload])

    def _build_cluster(self, world_size: int | None, device_kind: str | None,
                       capacity_gb: float | None) -> None:
        sess = self._session
        world = sess.world_size if sess is not None else (world_size or 8)
        kind = sess.device_kind if sess is not None else (device_kind or "cuda")
        self.world = widgets.BoundedIntText(value=world, min=1, max=100_000, description="World size (ranks)",
                                            style=_WIDE, disabled=sess is not None)
        self.device = widgets.Dropdown(options=["cuda", "cpu"], value=kind, description="Device",
                                       style=_WIDE, disabled=sess is not None)
        if capacity_gb is None:
            capacity_gb = self._session_capacity_gb() or _default_capacity_gb(kind)
        self.capacity_gb = widgets.BoundedFloatText(value=round(capacity_gb, 1), min=0, max=1e6,
                                                    description="Memory per rank (GB)", style=_WIDE)
        self.capacity_gb.add_class("mpnb-panel-capacity-input")
        where = "the running cluster" if sess is not None else "planning: no cluster running"
        self._cluster_note = widgets.HTML(f'<span style="color:#777;font-size:11px">{where}</span>')

    def _session_capacity_gb(self) -> float | None:
        if self._session is None:
            return None
        try:
            latest = self._session.memory.latest()
        except Exception:  # no monitor yet: fall back to the default
            return None
        caps = [int(s.get("capacity") or 0) for s in latest.values()]
        return max(caps) / 1e9 if caps and max(caps) > 0 else None

    def _build_model(self) -> None:
        model = self._model
        is_count = model is None or isinstance(model, int)
        self.num_params = widgets.Text(value=f"{model:,}" if isinstance(model, int) else "124M",
                                       description="Parameters", style=_WIDE)
        self.n_layer = widgets.BoundedIntText(value=12, min=0, max=10_000, description="Layers", style=_WIDE)
        self.hidden = widgets.BoundedIntText(value=768, min=0, max=1_000_000, description="Hidden size",
                                             style=_WIDE)
        self.n_head = widgets.BoundedIntText(value=12, min=0, max=10_000, description="Heads", style=_WIDE)
        self.vocab_size = widgets.BoundedIntText(value=50257, min=0, max=10_000_000, description="Vocabulary",
                                                 style=_WIDE)
        self.seq_len = widgets.BoundedIntText(value=1024, min=0, max=10_000_000,
                                              description="Sequence length", style=_WIDE)
        if is_count:
            rows = [self.num_params, self.n_layer, self.hidden, self.n_head, self.vocab_size, self.seq_len]
            title = "Model (size and shape; 0 = unknown)"
        else:
            cfg = getattr(model, "config", None)
            names = ("seq_len", "block_size", "n_positions", "max_position_embeddings")
            seq = next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), 0)
            self.seq_len.value = int(seq)
            count = sum(int(p.numel()) for p in {id(p): p for p in model.parameters()}.values())
            self.num_params.value = f"{count:,}"
            self.num_params.disabled = True
            rows = [self.num_params, self.seq_len]
            title = f"Model: {html.escape(type(model).__name__)}"
        self._model_box = widgets.VBox([widgets.HTML(f"<b>{title}</b>"), *rows])
        self._model_box.add_class("mpnb-panel-model")

    def _build_outputs(self, learning_rate: float | None) -> None:
        self.summary = widgets.HTML()
        self.summary.add_class("mpnb-panel-summary")
        self.message = widgets.HTML()
        self.message.add_class("mpnb-panel-message")
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="check")
        self.apply_button.add_class("mpnb-panel-apply")
        self.lr = widgets.FloatText(value=learning_rate or 0.0, description="Current learning rate",
                                    style=_WIDE)
        self.lr.add_class("mpnb-panel-lr")
        self.changes = widgets.HTML()
        self.changes.add_class("mpnb-panel-changes")
        self.bars = widgets.HTML()
        self.bars.add_class("mpnb-panel-estimate")
        self.compare = widgets.HTML()
        self.compare.add_class("mpnb-panel-compare")
        text_layout = widgets.Layout(width="100%", height="220px")
        self.ds_text = widgets.Textarea(layout=text_layout)
        self.ds_text.add_class("mpnb-panel-dsconfig")
        self.code_text = widgets.Textarea(layout=widgets.Layout(width="100%", height="320px"))
        self.code_text.add_class("mpnb-panel-code")
        self.ds_path = widgets.Text(value="ds_config.json", description="Save as", style=_WIDE)
        self.save_ds_button = widgets.Button(description="Save ds_config.json", icon="save")
        self.save_ds_button.add_class("mpnb-panel-save-ds")
        self.code_path = widgets.Text(value="mpnb_train.py", description="Save as", style=_WIDE)
        self.save_code_button = widgets.Button(description="Save code", icon="save")
        self.save_code_button.add_class("mpnb-panel-save-code")
        self.upload = widgets.FileUpload(accept=".json", multiple=False, description="Upload ds_config.json")
        self.upload.add_class("mpnb-panel-upload")
        self.import_path = widgets.Text(placeholder="path/to/ds_config.json", description="or path",
                                        style=_WIDE)
        self.load_button = widgets.Button(description="Load", icon="folder-open")
        self.load_button.add_class("mpnb-panel-load")
        self.io_message = widgets.HTML()
        self.io_message.add_class("mpnb-panel-io-message")

    def _layout(self) -> None:
        form = widgets.VBox([
            self.strategy, self._zero_box, self._fsdp_box, self._pipeline_box, self._tensor_box,
            self.precision, self.micro_batch_size, self.grad_accum_steps, self.activation_checkpointing,
            self._offload_box,
            widgets.HTML("<b>Cluster</b>"), self._cluster_note, self.world, self.device, self.capacity_gb,
        ], layout=widgets.Layout(width="48%", padding="0 12px 0 0"))
        form.add_class("mpnb-panel-form")
        estimate_tab = widgets.VBox([self._model_box, self.bars])
        export = widgets.VBox([
            widgets.HTML("<b>ds_config.json</b>"), self.ds_text,
            widgets.HBox([self.ds_path, self.save_ds_button]),
            widgets.HTML("<b>The plain PyTorch / DeepSpeed code this config runs</b>"), self.code_text,
            widgets.HBox([self.code_path, self.save_code_button]),
        ])
        export.add_class("mpnb-panel-export")
        importer = widgets.VBox([
            widgets.HTML("<b>Load a ds_config.json into the form</b> (then Apply)"),
            widgets.HBox([self.upload, self.import_path, self.load_button]), self.io_message,
        ])
        importer.add_class("mpnb-panel-import")
        self.tabs = widgets.Tab(children=[estimate_tab, self.compare, export, importer],
                                titles=["Estimate per rank", "Compare strategies", "Export", "Import"])
        right = widgets.VBox([self.tabs], layout=widgets.Layout(width="52%"))
        right.add_class("mpnb-panel-right")
        actions = widgets.HBox([self.apply_button, self.lr])
        self.children = [self.summary, widgets.HBox([form, right]), self.message, actions, self.changes]

    def _inputs(self) -> list[widgets.Widget]:
        return [
            self.strategy, self.zero_stage, self.reshard_after_forward, self.fsdp_wrap, self.pipeline_stages,
            self.pipeline_schedule, self.microbatches, self.tensor_parallel, self.precision,
            self.micro_batch_size, self.grad_accum_steps, self.activation_checkpointing, self.offload,
            self.world, self.device, self.capacity_gb, self.num_params, self.n_layer, self.hidden,
            self.n_head, self.vocab_size, self.seq_len,
        ]

    # ------------------------------------------------------------------ form <-> Config

    def world_size(self) -> int:
        return self._session.world_size if self._session is not None else int(self.world.value)

    def device_kind(self) -> str:
        return self._session.device_kind if self._session is not None else str(self.device.value)

    def capacity(self) -> int:
        return int(self.capacity_gb.value * 1e9)

    def _set_degree_options(self, cfg: Config) -> None:
        world = self.world_size()
        stages = _divisors_from_2(world)
        degrees = _divisors_from_2(world)
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

    # ------------------------------------------------------------------ live update

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

    def _refresh(self, change: Any = None) -> None:
        if self._updating:
            return
        if change is not None and change.get("owner") is self.world:
            self._updating = True
            try:
                self._set_degree_options(self.config)
            finally:
                self._updating = False
        self._update_visibility()
        world, device = self.world_size(), self.device_kind()
        try:
            cfg = self.pending_config()
            problems = cfg.problems(world, device)
        except ConfigError as exc:
            cfg, problems = None, [str(exc)]
        if problems:
            self.message.value = (
                '<div class="mpnb-panel-error" style="color:#c44e52">'
                + "".join(f"<div>{html.escape(p)}</div>" for p in problems) + "</div>"
            )
            self.apply_button.disabled = True
            self.apply_button.tooltip = problems[0]
        else:
            unchanged = cfg == self.config
            self.message.value = ""
            self.apply_button.disabled = unchanged
            self.apply_button.tooltip = "nothing changed" if unchanged else "send this config to every rank"
        self._show_summary(cfg, world)
        self._show_estimate(cfg if not problems else None, problems)
        self._show_compare(cfg)
        self._show_export(cfg if not problems else None, problems)

    def _show_summary(self, cfg: Config | None, world: int) -> None:
        if cfg is None:
            self.summary.value = '<b>mpnb config</b>'
            return
        batch = cfg.global_batch_size(world)
        before = self.config.global_batch_size(world)
        was = f" (applied: {before})" if batch != before else ""
        self.summary.value = (
            f"<b>mpnb config</b> · {html.escape(cfg.summary(world))} · {world} ranks · "
            f"global batch {batch}{was}"
        )

    def _estimate(self, cfg: Config) -> Estimate:
        world = self.world_size()
        if self._model is not None and not isinstance(self._model, int):
            return estimate(self._model, cfg, world, seq_len=self.seq_len.value or None)
        return estimate(
            parse_count(self.num_params.value), cfg, world,
            n_layer=self.n_layer.value or None, hidden=self.hidden.value or None,
            n_head=self.n_head.value or None, vocab_size=self.vocab_size.value or None,
            seq_len=self.seq_len.value or None,
        )

    def _show_estimate(self, cfg: Config | None, problems: list[str]) -> None:
        if cfg is None:
            self.last_estimate = None
            self.bars.value = ('<div class="mpnb-panel-estimate-bars mpnb-panel-unavailable" '
                               'style="color:#777">Fix the settings on the left to see the estimate.</div>')
            return
        try:
            est = self._estimate(cfg)
        except MpnbError as exc:
            self.last_estimate = None
            self.bars.value = _ERROR.format(html.escape(str(exc)))
            return
        self.last_estimate = est
        self.bars.value = estimate_html(est, self.capacity())

    def _compare_configs(self, cfg: Config | None) -> list[tuple[str, Config]]:
        form = cfg or self.config
        shared = {"precision": form.precision, "micro_batch_size": form.micro_batch_size,
                  "grad_accum_steps": form.grad_accum_steps,
                  "activation_checkpointing": form.activation_checkpointing}
        return [(name, Config(**shared, **kw)) for name, kw in COMPARE]

    def compare_estimates(self) -> dict[str, Estimate | str]:
        """{"DDP": Estimate, "ZeRO-1": ..., "FSDP": ...} for the form's model, batch and precision."""
        out: dict[str, Estimate | str] = {}
        try:
            cfg: Config | None = self.pending_config()
        except ConfigError:
            cfg = None
        for name, c in self._compare_configs(cfg):
            try:
                out[name] = self._estimate(c)
            except MpnbError as exc:
                out[name] = str(exc)
        return out

    def _show_compare(self, cfg: Config | None) -> None:
        rows = list(self.compare_estimates().items())
        intro = ('<div style="font-size:12px;margin-bottom:4px">The most loaded rank under each '
                 "data-parallel strategy, same model, batch and precision: the ZeRO paper's Figure 1 "
                 "for your model.</div>")
        self.compare.value = intro + compare_html(rows, self.capacity())

    def _show_export(self, cfg: Config | None, problems: list[str]) -> None:
        if cfg is None:
            self.ds_text.value = ""
            self.code_text.value = ""
            return
        world = self.world_size()
        try:
            self.ds_text.value = json.dumps(cfg.to_deepspeed(world), indent=2) + "\n"
        except ConfigError as exc:
            self.ds_text.value = f"// {exc}\n"
        self.code_text.value = cfg.to_code(world, self.device_kind())

    # ------------------------------------------------------------------ apply

    def _on_apply(self, _button: Any = None) -> None:
        self.apply()

    def apply(self) -> Config:
        """Apply the form: validate, send to every engine (when a cluster runs), report what changed."""
        world, device = self.world_size(), self.device_kind()
        try:
            cfg = self.pending_config().validate(world, device)
            old = self.config
            if self._session is not None:
                self._applying = True
                try:
                    self._session.set_config(cfg)
                finally:
                    self._applying = False
        except MpnbError as exc:
            self.message.value = _ERROR.format(html.escape(str(exc)))
            return self.config
        self.config = cfg
        if self._session is not None and self.last_estimate is not None:
            # the live memory chart draws this as its dashed "predicted" line
            with contextlib.suppress(MpnbError):
                self._session.memory.estimate = self._estimate(cfg).by_rank()
        diff = old.diff(cfg)
        where = "sent to every rank; the next mpnb.prepare uses it" if self._session is not None else (
            "kept in this panel (no cluster running); `panel.config` has it")
        if diff:
            items = "".join(f"<li><code>{k}</code>: {html.escape(repr(a))} → {html.escape(repr(b))}</li>"
                            for k, (a, b) in diff.items())
            self._applied_note = f"<div><b>Applied</b> ({where}):<ul style='margin:2px 0'>{items}</ul></div>"
        else:
            self._applied_note = f"<div><b>Applied</b> ({where}): nothing changed.</div>"
        before, after = old.global_batch_size(world), cfg.global_batch_size(world)
        self._batch_change = (before, after) if before != after else None
        self._show_changes()
        self._refresh()
        return cfg

    def _show_changes(self) -> None:
        parts = [self._applied_note]
        if self._batch_change is not None:
            parts.append(batch_change_message(*self._batch_change, float(self.lr.value or 0.0)))
        self.changes.value = "".join(parts)

    # ------------------------------------------------------------------ sync with the session

    def _on_session_change(self, sess: Any) -> None:
        event = getattr(sess, "last_event", "config")
        if getattr(sess, "closed", False) or event == "stop":
            if sess is self._session:
                self._session = None
                self.world.disabled = self.device.disabled = False
                self._cluster_note.value = ('<span style="color:#777;font-size:11px">the cluster stopped: '
                                            "planning only</span>")
            return
        if event not in ("config", "start", "restart") or self._applying:
            return
        if sess is not self._session:  # a cluster started while the panel was open: edit its config
            self._session = sess
            self._updating = True
            try:
                self.world.value = sess.world_size
                self.device.value = sess.device_kind
            finally:
                self._updating = False
            self.world.disabled = self.device.disabled = True
            self._cluster_note.value = '<span style="color:#777;font-size:11px">the running cluster</span>'
            self._refresh()
        if sess.config != self.config:
            self.config = sess.config
            self._set_form(sess.config)
            now = html.escape(sess.config.summary())
            self._applied_note = ("<div>The session's config changed outside the panel (e.g. "
                                  f"<code>%mpnb config</code>): now {now}.</div>")
            self._batch_change = None
            self._show_changes()
            self._refresh()

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        super().close()

    # ------------------------------------------------------------------ import / export

    def load_deepspeed(self, ds: dict[str, Any] | str, source: str = "ds_config") -> Config | None:
        """Put a ds_config into the form (not applied yet). Returns the Config, or None with a message."""
        try:
            cfg = Config.from_deepspeed(ds, world_size=self.world_size())
        except ConfigError as exc:
            self.io_message.value = f'<span style="color:#c44e52">{html.escape(str(exc))}</span>'
            return None
        self._set_form(cfg)
        self.io_message.value = (f"Loaded {html.escape(source)}: {html.escape(cfg.summary())}. "
                                 "Check the estimate, then Apply.")
        self._refresh()
        return cfg

    def _on_load_path(self, _button: Any = None) -> None:
        path = Path(self.import_path.value).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            self.io_message.value = (f'<span style="color:#c44e52">Cannot read {html.escape(str(path))}: '
                                     f"{html.escape(exc.strerror or str(exc))}. Check the path.</span>")
            return
        self.load_deepspeed(text, source=str(path))

    def _on_upload(self, change: dict[str, Any]) -> None:
        files = change["new"]
        if not files:
            return
        item = files[0] if isinstance(files, (list, tuple)) else next(iter(files.values()))
        content = item["content"]
        text = bytes(content).decode("utf-8", errors="replace")
        self.load_deepspeed(text, source=item.get("name", "upload"))
        self.upload.value = ()  # so the same file can be uploaded again after editing it

    def _save(self, path_text: str, content: str) -> None:
        if not content or content.startswith("//"):
            self.io_message.value = ('<span style="color:#c44e52">Nothing to save: this config has no '
                                     "ds_config (see the code instead).</span>")
            return
        path = Path(path_text).expanduser()
        try:
            path.write_text(content)
        except OSError as exc:
            self.io_message.value = (f'<span style="color:#c44e52">Cannot write {html.escape(str(path))}: '
                                     f"{html.escape(exc.strerror or str(exc))}.</span>")
            return
        self.io_message.value = f"Saved {html.escape(str(path))} ({len(content.encode())} bytes)."

    def __repr__(self) -> str:
        return f"<mpnb.ConfigPanel {self.config.summary(self.world_size())}>"


def batch_change_message(before: int, after: int, lr: float) -> str:
    """Say that the global batch changed and what the learning rate could become."""
    ratio = after / before
    head = (f"<div class='mpnb-panel-batch-change'><b>The global batch size changed: {before} → {after} "
            f"({_TIMES}{ratio:.3g}).</b> ")
    if lr > 0:
        body = (f"Your learning rate {lr:.3g} would become <b>{lr * ratio:.3g}</b> under linear scaling "
                f"(Goyal et al. 2017, SGD) or <b>{lr * math.sqrt(ratio):.3g}</b> under square-root scaling "
                "(often better for Adam). Re-tune after scaling: large changes need warm-up.")
    else:
        body = (f"Scale the learning rate by {_TIMES}{ratio:.3g} (linear rule) or "
                f"{_TIMES}{math.sqrt(ratio):.3g} "
                "(square-root rule); enter your current learning rate for the numbers.")
    return head + body + "</div>"
