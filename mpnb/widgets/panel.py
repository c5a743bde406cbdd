"""`mpnb.config_panel()`: choose a strategy, see what each rank will hold, apply it.

The panel edits the live session's `mpnb.Config` (or a standalone one when no
cluster runs, with a world size to plan for). Every change re-validates the
form with `Config.problems` and re-runs `mpnb.estimate`, so the bars and the
message follow the form at once; Apply pushes the config to every engine
through `Session.set_config`, and `Session.on_change` brings changes made
elsewhere (`%mpnb config zero_stage=3`) back into an open panel.

`ConfigPanel` is assembled from one part per job: `panel_plan` (world, device,
memory per rank, model), `panel_form` (the Config controls), `panel_views`
(summary, estimate bars, strategy comparison), `panel_measured` (what
`mpnb.compare` measured, and "Measure these"), `panel_files` (ds_config and
code export/import) and `panel_apply` (Apply and the link to the session).

Stable CSS classes for browser tests and styling: `mpnb-panel` (root),
`mpnb-panel-form`, `mpnb-panel-strategy`, `mpnb-panel-zero-stage`,
`mpnb-panel-apply`, `mpnb-panel-apply-status`, `mpnb-panel-message`, `mpnb-panel-summary`,
`mpnb-panel-changes`, `mpnb-panel-estimate`, `mpnb-panel-compare`,
`mpnb-panel-measured`, `mpnb-panel-measure` (see `mpnb.widgets.panel_measured`),
`mpnb-panel-export`, `mpnb-panel-import`, `mpnb-panel-lr`, `mpnb-panel-capacity-input`,
and inside the bars (see `mpnb.widgets.bars`) `mpnb-panel-row` (data-rank or
data-strategy, data-total, data-fits), `mpnb-panel-bar`, `mpnb-panel-seg-<category>`
(data-bytes), `mpnb-panel-capacity`, `mpnb-panel-warning`.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from mpnb.errors import ConfigError
from mpnb.planning.config import Config
from mpnb.planning.estimator import Estimate
from mpnb.widgets.panel_apply import SessionLink
from mpnb.widgets.panel_files import ConfigFiles
from mpnb.widgets.panel_plan import parse_count, requested_capacity
from mpnb.widgets.panel_style import ERROR_HTML

__all__ = ["ConfigPanel", "config_panel", "parse_count"]


def config_panel(model: Any = None, *, world_size: int | None = None, device_kind: str | None = None,
                 capacity_gib: float | None = None, capacity_gb: float | None = None,
                 learning_rate: float | None = None) -> ConfigPanel:
    """Open the config panel for the live session (or standalone, planning for `world_size` ranks).

    `model` is an nn.Module or a parameter count; without one the panel asks
    for the size and shape (default: GPT-2 small). Memory per rank is
    `capacity_gib` in GiB (2**30 bytes), or `capacity_gb` in decimal GB
    (10**9 bytes, as spec sheets quote it); by default the running cluster's,
    else the machine's memory for CPU ranks or 80 GiB for a GPU.
    """
    return ConfigPanel(model, world_size=world_size, device_kind=device_kind, capacity_gib=capacity_gib,
                       capacity_gb=capacity_gb, learning_rate=learning_rate)


def _current_session() -> Any | None:
    from mpnb.cluster import session as cluster

    return cluster.current()


class ConfigPanel(SessionLink, ConfigFiles, widgets.VBox):
    """The widget `config_panel()` returns; attributes named after Config fields are its controls."""

    def __init__(self, model: Any = None, *, world_size: int | None = None, device_kind: str | None = None,
                 capacity_gib: float | None = None, capacity_gb: float | None = None,
                 learning_rate: float | None = None) -> None:
        capacity = requested_capacity(capacity_gib, capacity_gb)
        super().__init__()
        self.add_class("mpnb-panel")
        self._model = model
        self._session = _current_session()
        self._updating = False
        self._applying = False
        self._unsubscribe: Any = None
        self._batch_change = None
        self._applied_note = ""
        self.config: Config = self._session.config if self._session is not None else Config()
        self.last_estimate: Estimate | None = None

        self._build_form()
        self._build_cluster(world_size, device_kind, capacity)
        self._build_model()
        self._build_views()
        self._build_measured()
        self._build_apply(learning_rate)
        self._build_files()
        self._layout()
        self._set_form(self.config)
        for w in self._form_inputs() + self._plan_inputs():
            w.observe(self._refresh, names="value")
        self._follow_sessions()
        self._refresh()

    def _layout(self) -> None:
        form = widgets.VBox([
            self.strategy, self.strategy_note, self._support_css,
            self._zero_box, self._fsdp_box, self._pipeline_box, self._tensor_box,
            self.precision, self.micro_batch_size, self.grad_accum_steps, self.activation_checkpointing,
            self._offload_box,
            widgets.HTML("<b>Cluster</b>"), self._cluster_note, self.world, self.device, self.capacity_gib,
        ], layout=widgets.Layout(width="48%", padding="0 12px 0 0"))
        form.add_class("mpnb-panel-form")
        estimate_tab = widgets.VBox([self._model_box, self.bars])
        export, importer = self._files_tabs()
        self.tabs = widgets.Tab(children=[estimate_tab, self.compare_tab, export, importer],
                                titles=["Estimate per rank", "Compare strategies", "Export", "Import"])
        right = widgets.VBox([self.tabs], layout=widgets.Layout(width="52%"))
        right.add_class("mpnb-panel-right")
        actions = widgets.HBox([self.apply_button, self.apply_status],
                               layout=widgets.Layout(align_items="center"))
        self.children = [self.summary, widgets.HBox([form, right]), self.message, actions, self.changes,
                         self._lr_box]

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
        self._update_support(world)
        try:
            cfg: Config | None = self.pending_config()
            problems = cfg.problems(world, device)
        except ConfigError as exc:
            cfg, problems = None, [str(exc)]
        unsupported = self.model_problem(cfg, world) if cfg is not None else None
        if unsupported:  # a strategy from the session or an import, or a TP degree that splits heads
            problems = [unsupported, *problems]
        if problems:
            self.message.value = ERROR_HTML.format("".join(f"<div>{html.escape(p)}</div>" for p in problems))
        else:
            self.message.value = ""
        before = self.config.global_batch_size(world)
        batch_changes = cfg is not None and cfg.global_batch_size(world) != before
        self._show_apply_state(problems[0] if problems else None, cfg == self.config, batch_changes)
        self._show_summary(cfg, world)
        self._show_estimate(cfg if not problems else None)
        self._show_compare()
        self._show_export(cfg if not problems else None)

    def __repr__(self) -> str:
        return f"<mpnb.ConfigPanel {self.config.summary(self.world_size())}>"
