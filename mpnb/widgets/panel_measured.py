"""The Compare tab's measured half: what `mpnb.compare` measured for the panel's model, and "Measure these".

Once a comparison has run on the live cluster for the model the panel plans for (same parameter
count Ψ, same world size), the tab shows, per config, the busiest rank's model states and everything
it held beside `mpnb.estimate`'s prediction, the median step time and the bytes sent per step beside
the predicted bytes. "Measure these" runs the session's training cell (the newest `%%distributed` or
`%%compare` cell that calls `mpnb.prepare` and `.step(`) under the ticked strategies, through
`mpnb.compare`.

Stable CSS classes: `mpnb-panel-measured` (the table, or why there is none), its rows
`mpnb-panel-measured-row` (data-config, data-states, data-predicted-states, data-total,
data-predicted-total, data-step-s, data-comm-bytes, data-predicted-comm), `mpnb-panel-measure`
(the button), `mpnb-panel-measure-pick` (the tick boxes), `mpnb-panel-measure-status`.
"""

from __future__ import annotations

import html
import statistics
from typing import Any

import ipywidgets as widgets
from IPython.display import HTML

from mpnb.comparison.runner import STEPS, WARMUP, compare
from mpnb.errors import MpnbError
from mpnb.units import format_bytes
from mpnb.widgets.panel_style import ERROR_HTML, NOTE_SPAN
from mpnb.widgets.panel_views import COMPARE, EstimateViews

MAGICS = ("%%distributed", "%%compare")
MODEL_STATES = ("parameters", "gradients", "optimizer")
CELL = "padding:1px 5px;white-space:nowrap;text-align:right"


def training_cell(shell: Any, fallback: Any = None) -> tuple[str, str] | None:
    """(label, engine code) of the newest training cell in `shell`'s history, else `fallback`'s cell.

    A training cell is a `%%distributed` (on every rank) or `%%compare` cell whose code calls
    `prepare(` and `.step(`; `fallback` is the session's last `Comparison` (`mpnb.compare` called
    from Python with code of its own)."""
    raw = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None) or []
    for number in range(len(raw) - 1, 0, -1):
        head, _, body = raw[number].lstrip().partition("\n")
        words = head.split()
        if words and words[0] in MAGICS and "--rank" not in head and "prepare(" in body and ".step(" in body:
            return f"In [{number}]", body
    if fallback is not None and fallback.cell:
        return fallback.origin or "the last compared cell", fallback.cell
    return None


def measured_html(comparison: Any, num_params: int | None, world_size: int) -> str:
    """The measured table for the panel's model, or a line saying why there is none."""
    if comparison is None:
        return _note("Nothing measured yet: tick strategies and press <b>Measure these</b> to run your "
                     "training cell under each and see measured memory, step time and bytes sent here.")
    measured_psi = comparison.num_params
    if measured_psi is None:
        return _note("The last comparison measured nothing (" + html.escape(comparison.verdict()) + ")")
    if measured_psi != num_params or comparison.world_size != world_size:
        return _note(f"The last comparison measured a model of {measured_psi:,} parameters on "
                     f"{comparison.world_size} ranks; this panel plans for {num_params or 0:,} on "
                     f"{world_size}. "
                     "Measure these to see this model's numbers.")
    where = f" with {html.escape(comparison.origin)}" if comparison.origin else ""
    head = "".join(f"<th style='{CELL}'>{h}</th>" for h in (
        "config", "model states", "everything", "step, median<br>(min-max)", "sent per step", "losses"))
    rows = "".join(_row(comparison, run) for run in comparison.runs)
    return (
        '<div class="mpnb-panel-measured" style="font-size:12px;margin:4px 0 8px;line-height:1.35">'
        f"<b>0 · Measured on this cluster</b>{where}: {comparison.world_size} ranks, "
        f"{comparison.steps} timed steps after {comparison.warmup} warm-up; the busiest rank of each config, "
        "with <span style='color:#777'>mpnb.estimate's prediction</span> under each number."
        f"<div style='overflow-x:auto'><table style='font-size:12px;margin-top:2px'><tr>{head}</tr>{rows}"
        "</table></div>"
        f"<div style='color:#555;font-size:11px'>{html.escape(comparison.verdict())} "
        "<code>panel.comparison.table</code> has every rank.</div></div>"
    )


def _row(comparison: Any, run: Any) -> str:
    label = html.escape(run.label)
    if not run.measured:
        why = html.escape(f"{run.status}: {run.error}" if run.error else run.status)
        return (f"<tr class='mpnb-panel-measured-row' data-config='{label}' data-status='{run.status}'>"
                f"<td style='{CELL};text-align:left'>{label}</td>"
                f"<td colspan='5' style='color:#c44e52;padding:1px 6px'>{why}</td></tr>")
    busy = run.busiest()
    held, est = busy.get("memory") or {}, busy.get("estimate") or {}
    states = sum(held.get(k, 0) for k in MODEL_STATES)
    predicted_states = sum(est.get(k, 0) for k in MODEL_STATES) if est else None
    total, predicted_total = run.memory(busy), est.get("total")
    slow = run.slowest()["times"]
    step = statistics.median(slow)
    sent = run.bytes_per_step()
    predicted_comm = max((sum(r.get("estimate_comm", {}).values()) for r in run.ranks), default=0)
    losses = "equal" if comparison.losses_match(run) else "<span style='color:#c44e52'>differ</span>"
    cells = [label, _pair(format_bytes(states), format_bytes(predicted_states)),
             _pair(format_bytes(total), format_bytes(predicted_total)),
             _pair(f"{step * 1e3:.1f} ms", f"{min(slow) * 1e3:.1f}-{max(slow) * 1e3:.1f}"),
             _pair(format_bytes(sent), format_bytes(predicted_comm) if predicted_comm else "-"), losses]
    tds = "".join(f"<td style='{CELL}{';text-align:left;white-space:normal' if i == 0 else ''}'>{c}</td>"
                  for i, c in enumerate(cells))
    return (f"<tr class='mpnb-panel-measured-row' data-config='{label}' data-status='ok' "
            f"data-states='{states}' data-predicted-states='{predicted_states or 0}' data-total='{total}' "
            f"data-predicted-total='{predicted_total or 0}' data-step-s='{step:.6f}' "
            f"data-comm-bytes='{int(sent)}' data-predicted-comm='{predicted_comm}'>{tds}</tr>")


def _pair(measured: str, second: str) -> str:
    """A measured number over the prediction (for time: the range, min-max) in grey."""
    return f"{measured}<br><span style='color:#777;font-size:11px'>{second}</span>"


def _note(text: str) -> str:
    return f'<div class="mpnb-panel-measured" style="color:#555;font-size:12px;margin:4px 0 8px">{text}</div>'


class MeasuredViews(EstimateViews):
    """The measured table above the Compare tab's predictions, and the "Measure these" controls."""

    _session: Any

    def _build_measured(self) -> None:
        # as wide as the tab, not as its table: a wider widget would be cut off at the tab's edge
        self.measured = widgets.HTML(layout=widgets.Layout(width="98%"))
        self.measure_picks = {name: widgets.Checkbox(value=True, description=name, indent=False,
                                                     layout=widgets.Layout(width="auto"))
                              for name, _ in COMPARE}
        for box in self.measure_picks.values():
            box.observe(lambda _: self._show_measure_state(), names="value")
        picks = widgets.HBox(list(self.measure_picks.values()))
        picks.add_class("mpnb-panel-measure-pick")
        self.measure_button = widgets.Button(description="Measure these", icon="play",
                                             tooltip="run the training cell under each ticked strategy")
        self.measure_button.add_class("mpnb-panel-measure")
        self.measure_button.on_click(lambda _: self.measure())
        self.measure_status = widgets.HTML()
        self.measure_status.add_class("mpnb-panel-measure-status")
        self.measure_output = widgets.Output()
        self._measuring = False
        self.compare_tab = widgets.VBox([
            self.measured, picks,
            widgets.HBox([self.measure_button, self.measure_status],
                         layout=widgets.Layout(align_items="center")),
            self.measure_output, self.compare,
        ])

    @property
    def comparison(self) -> Any:
        """The session's last `mpnb.compare` result (None without a session or a comparison)."""
        return getattr(self._session, "comparison", None)

    def _training_cell(self) -> tuple[str, str] | None:
        from IPython import get_ipython

        return training_cell(get_ipython(), self.comparison)

    def _show_compare(self) -> None:
        super()._show_compare()
        self.measured.value = measured_html(self.comparison, self.planned_params, self.world_size())
        self._show_measure_state()

    def _show_measure_state(self) -> None:
        """Enable "Measure these" only when it can run, and say what it will run or why it cannot."""
        cell = self._training_cell() if self._session is not None else None
        picked = [name for name, box in self.measure_picks.items() if box.value]
        if self._measuring:
            why = "measuring: the stop button ends it; the configs measured so far are kept"
        elif self._session is None:
            why = "no cluster running: start one with <code>%mpnb start</code>, then run your training cell"
        elif cell is None:
            why = ("no training cell yet: run a <code>%%distributed</code> cell that calls "
                   f"<code>mpnb.prepare</code> and <code>trainer.step</code> (at least {WARMUP + STEPS} "
                   "steps) first")
        elif not picked:
            why = "tick at least one strategy"
        else:
            why = (f"runs {html.escape(cell[0])} under {', '.join(picked)}: {WARMUP} warm-up and {STEPS} "
                   "timed steps each, then puts your config back")
        ready = not self._measuring and self._session is not None and cell is not None and bool(picked)
        self.measure_button.disabled = not ready
        self.measure_button.button_style = "info" if ready else ""
        self.measure_status.value = NOTE_SPAN.format(why)

    def measure(self) -> Any:
        """Run the training cell under the ticked strategies (`mpnb.compare`); returns the Comparison."""
        cell = self._training_cell() if self._session is not None else None
        picked = [kw for name, kw in COMPARE if self.measure_picks[name].value]  # labelled "zero stage=1"
        if cell is None or not picked:
            self._show_measure_state()
            return None
        self._measuring = True
        self._show_measure_state()
        self.measure_output.clear_output()
        result = None
        try:
            with self.measure_output:  # progress while it runs; the table above says the rest
                result = compare(picked, cell[1], chart=False, origin=cell[0])
            if not result.stopped:
                self.measure_output.clear_output()
        except MpnbError as exc:  # e.g. a strategy this world cannot run: refused before anything ran
            self.measure_output.append_display_data(HTML(ERROR_HTML.format(html.escape(str(exc)))))
        finally:
            self._measuring = False
            self._show_compare()
        return result
