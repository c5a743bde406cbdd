"""Applying the config panel's form to the session, and following the session's changes.

Apply validates the form, pushes the config to every engine through
`Session.set_config` and says what changed (and what the learning rate could
become when the global batch changed). The panel listens to every session
(`mpnb.cluster.session.on_change`), so `%mpnb config ...`, a cluster started
after the panel opened, and a stopped cluster all show in an open panel.
"""

from __future__ import annotations

import contextlib
import html
import math
from typing import Any

import ipywidgets as widgets

from mpnb.errors import MpnbError
from mpnb.planning.config import Config
from mpnb.planning.model_support import check_config
from mpnb.widgets.panel_measured import MeasuredViews
from mpnb.widgets.panel_style import ERROR_HTML, NOTE_SPAN, WIDE_LABELS

_TIMES = "\u00d7"  # the multiplication sign, spelled out for the linter


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


class SessionLink(MeasuredViews):
    """The Apply button, its report, and the two-way link between `ConfigPanel` and the live session."""

    _applying: bool  # True while our own set_config runs: its change event is not news to the panel
    _unsubscribe: Any = None  # ends the panel's on_change subscription
    _batch_change: tuple[int, int] | None  # (before, after) global batch of the last Apply, if it changed
    _applied_note: str

    def _build_apply(self, learning_rate: float | None) -> None:
        self.message = widgets.HTML()
        self.message.add_class("mpnb-panel-message")
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="check")
        self.apply_button.add_class("mpnb-panel-apply")
        self.apply_status = widgets.HTML()  # why Apply is greyed out, or what it will do
        self.apply_status.add_class("mpnb-panel-apply-status")
        # only asked for when the global batch changes: it feeds the learning-rate advice, nothing else
        self.lr = widgets.FloatText(value=learning_rate or 0.0, description="Your learning rate",
                                    style=WIDE_LABELS)
        self.lr.add_class("mpnb-panel-lr")
        self._lr_box = widgets.HBox([self.lr, widgets.HTML(NOTE_SPAN.format(
            "optional: only for the advice on rescaling it to the new global batch; "
            "mpnb does not change your optimizer"))])
        self._lr_box.layout.display = "none"
        self.changes = widgets.HTML()
        self.changes.add_class("mpnb-panel-changes")

    def _follow_sessions(self) -> None:
        self.lr.observe(lambda _: self._show_changes(), names="value")
        self.apply_button.on_click(self._on_apply)
        # listen to every session, so a cluster started after the panel opened is picked up too
        from mpnb.cluster import session as cluster

        self._unsubscribe = cluster.on_change(self._on_session_change)

    def _on_apply(self, _button: Any = None) -> None:
        self.apply()

    def apply(self) -> Config:
        """Apply the form: validate, send to every engine (when a cluster runs), report what changed."""
        world, device = self.world_size(), self.device_kind()
        try:
            cfg = self.pending_config().validate(world, device)
            check_config(self._model, cfg, world)  # the model cannot run it: nothing is sent
            old = self.config
            if self._session is not None:
                self._applying = True
                try:
                    self._session.set_config(cfg)
                finally:
                    self._applying = False
        except MpnbError as exc:
            self.message.value = ERROR_HTML.format(html.escape(str(exc)))
            return self.config
        self.config = cfg
        if self._session is not None and self.last_estimate is not None and self._model is not None:
            # the live chart's dashed line, only for a model the user gave (not the GPT-2 default);
            # the next mpnb.prepare replaces it with the estimate for the model it prepares
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

    def _show_apply_state(self, problem: str | None, unchanged: bool, batch_changes: bool) -> None:
        """Apply looks enabled (primary) only when it is, and says why when it is not."""
        if problem is not None:
            enabled, why = False, "fix the settings above first"
        elif unchanged:
            enabled, why = False, "nothing to apply: the form shows the applied config; change a setting"
        else:
            enabled = True
            why = "keeps this config in the panel (no cluster running)"
            if self._session is not None:
                why = "sends this config to every rank; the next mpnb.prepare uses it"
        self.apply_button.disabled = not enabled
        self.apply_button.button_style = "primary" if enabled else ""
        self.apply_button.tooltip = problem or why
        self.apply_status.value = NOTE_SPAN.format(html.escape(why))
        show_lr = batch_changes or self._batch_change is not None
        self._lr_box.layout.display = "" if show_lr else "none"

    def _on_session_change(self, sess: Any) -> None:
        event = getattr(sess, "last_event", "config")
        if getattr(sess, "closed", False) or event == "stop":
            if sess is self._session:
                self._session = None
                self.world.disabled = self.device.disabled = False
                self._cluster_note.value = NOTE_SPAN.format("the cluster stopped: planning only")
            return
        if sess is self._session and event in ("comparison", "cell"):
            if event == "comparison":
                self._show_compare()  # the measured table
            elif not sess.comparing:
                self._show_measure_state()  # a new training cell may have run
            return
        if event not in ("config", "start", "restart") or self._applying or getattr(sess, "comparing", False):
            return  # a comparison's config switches are not the user's: it puts the config back
        if sess is not self._session:  # a cluster started while the panel was open: edit its config
            self._session = sess
            self._updating = True
            try:
                self.world.value = sess.world_size
                self.device.value = sess.device_kind
            finally:
                self._updating = False
            self.world.disabled = self.device.disabled = True
            self._cluster_note.value = NOTE_SPAN.format("the running cluster")
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
        super().close()  # the widget's own close: VBox comes later in ConfigPanel's bases
