"""What the config panel shows about the form's config: the summary line, per-rank bars, strategy comparison.

Each view is redrawn from the form on every change (`ConfigPanel._refresh`);
the numbers come from `mpnb.estimate` for the model the panel plans for.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from mpnb.errors import ConfigError, MpnbError
from mpnb.planning.config import Config
from mpnb.planning.estimator import Estimate, estimate
from mpnb.widgets.bars import estimate_html
from mpnb.widgets.panel_compare import compare_html
from mpnb.widgets.panel_form import StrategyForm
from mpnb.widgets.panel_plan import parse_count
from mpnb.widgets.panel_style import ERROR_HTML

# the data-parallel strategies of the ZeRO paper's Figure 1, compared under the form's batch and precision
COMPARE = [
    ("DDP", {"strategy": "ddp"}),
    ("ZeRO-1", {"strategy": "zero", "zero_stage": 1}),
    ("ZeRO-2", {"strategy": "zero", "zero_stage": 2}),
    ("ZeRO-3", {"strategy": "zero", "zero_stage": 3}),
    ("FSDP", {"strategy": "fsdp"}),
]


class EstimateViews(StrategyForm):
    """The summary line, the "Estimate per rank" bars and the "Compare strategies" tab of `ConfigPanel`."""

    last_estimate: Estimate | None  # the estimate the bars show, None when the form cannot be estimated
    planned_params: int | None = None  # Ψ of the model the panel plans for (None if it cannot be estimated)

    def _build_views(self) -> None:
        self.summary = widgets.HTML()
        self.summary.add_class("mpnb-panel-summary")
        self.bars = widgets.HTML()
        self.bars.add_class("mpnb-panel-estimate")
        self.compare = widgets.HTML()
        self.compare.add_class("mpnb-panel-compare")

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

    def _show_estimate(self, cfg: Config | None) -> None:
        if cfg is None:
            self.last_estimate = None
            self.bars.value = ('<div class="mpnb-panel-estimate-bars mpnb-panel-unavailable" '
                               'style="color:#777">Fix the settings on the left to see the estimate.</div>')
            return
        try:
            est = self._estimate(cfg)
        except MpnbError as exc:
            self.last_estimate = None
            self.bars.value = ERROR_HTML.format(html.escape(str(exc)))
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

    def _show_compare(self) -> None:
        rows = list(self.compare_estimates().items())
        self.planned_params = next((est.num_params for _, est in rows if isinstance(est, Estimate)), None)
        try:
            precision = self.pending_config().precision
        except ConfigError:
            precision = self.config.precision
        self.compare.value = compare_html(rows, self.capacity(), precision)
