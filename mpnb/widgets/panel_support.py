"""The strategies the panel's model can run under: the others greyed out, with the reason on screen.

ipywidgets' ToggleButtons cannot disable one option, so the panel greys an
unsupported one with CSS (a class per strategy on the buttons), puts the reason
in that button's tooltip and in a visible line under the buttons, and snaps a
click on it back to the strategy before, pointing at the reason. A config that
arrives with such a strategy (from the session, an import) is shown as a problem
and cannot be applied. The reasons come from `mpnb.planning.model_support`, the
same words `%mpnb config` and the engine use.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from mpnb.planning.model_support import STRATEGIES, config_problem, strategy_support

OFF_CLASS = "mpnb-panel-strategy-off-{}"
# one rule per strategy: the ToggleButtons view marks each button with data-value = its label
_CSS = "".join(
    f".{OFF_CLASS.format(value)} button[data-value='{label}']"
    "{opacity:0.45;cursor:not-allowed;text-decoration:line-through;box-shadow:none}"
    for label, value in (("DDP", "ddp"), ("FSDP", "fsdp"), ("ZeRO", "zero"), ("Pipeline", "pipeline"),
                         ("Tensor", "tensor"))
)
STRATEGY_CSS = f"<style>{_CSS}</style>"
NOTE_DIV = "<div style='color:#777;font-size:11px;line-height:1.4;margin:0 0 4px 0'>{}</div>"


class StrategyGate:
    """Which strategies `ConfigPanel` offers for its model, and the note that says why not the others."""

    _model: Any
    _updating: bool
    config: Any
    strategy: widgets.ToggleButtons

    def _build_support(self, tips: list[str]) -> None:
        """After the form is built and before `_refresh` observes it (a refused click never reaches it)."""
        self._tips = list(tips)
        self._support: dict[str, str | None] = dict.fromkeys(STRATEGIES)
        self._support_key: tuple[int, bool] | None = None
        self._refused: str | None = None  # the strategy last clicked and refused: its reason is highlighted
        self.strategy_note = widgets.HTML()
        self.strategy_note.add_class("mpnb-panel-strategy-note")
        self._support_css = widgets.HTML(STRATEGY_CSS, layout=widgets.Layout(display="none"))
        self.strategy.observe(self._refuse_unsupported, names="value")

    def supported_strategies(self) -> dict[str, str | None]:
        """{strategy: None if the model can use it, else why not}, for the world the panel plans for."""
        return dict(self._support)

    def _update_support(self, world: int) -> None:
        key = (world, bool(self.config.tensor_plan))
        if key == self._support_key:
            return
        self._support_key = key
        self._support = strategy_support(self._model, world, tensor_plan=dict(self.config.tensor_plan))
        self.strategy.tooltips = [self._support[value] or tip
                                  for (_, value), tip in zip(self.strategy.options, self._tips, strict=True)]
        for value, reason in self._support.items():
            if reason:
                self.strategy.add_class(OFF_CLASS.format(value))
            else:
                self.strategy.remove_class(OFF_CLASS.format(value))
        self._show_support_note()

    def _refuse_unsupported(self, change: Any) -> None:
        if self._updating:  # set from code (the session's config): `support_problem` reports it instead
            return
        if self._support.get(change["new"]) is None:
            self._refused = None
        else:
            self._refused = change["new"]
            self._updating = True
            try:
                self.strategy.value = change["old"]
            finally:
                self._updating = False
        self._show_support_note()

    def _show_support_note(self) -> None:
        lines = []
        for value, reason in self._support.items():
            if reason:
                style = "color:#c44e52;font-weight:bold" if value == self._refused else ""
                lines.append(f"<div class='mpnb-panel-strategy-reason' data-strategy='{value}' "
                             f"style='{style}'>&#8856; {html.escape(reason)}</div>")
        self.strategy_note.value = NOTE_DIV.format("".join(lines)) if lines else ""
        self.strategy_note.layout.display = "" if lines else "none"

    def model_problem(self, cfg: Any, world: int) -> str | None:
        """Why the model cannot run `cfg` (its strategy, or a TP degree that splits heads), or None."""
        return config_problem(self._model, cfg, world)
