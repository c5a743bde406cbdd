"""The config panel's Export and Import tabs: the form as a ds_config and as plain code, and back.

Export shows the ds_config.json and the plain PyTorch / DeepSpeed script of the
form's config and saves either to a file; Import reads a ds_config (a path or an
upload) into the form without applying it, so the estimate can be checked first.
"""

from __future__ import annotations

import html
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from mpnb.errors import ConfigError
from mpnb.planning.config import Config
from mpnb.planning.ds_config import MAX_DS_CONFIG_CHARS
from mpnb.widgets.panel_form import StrategyForm
from mpnb.widgets.panel_style import ERROR_SPAN, WIDE_LABELS


class ConfigFiles(StrategyForm):
    """The Export and Import tabs of `ConfigPanel`."""

    def _build_files(self) -> None:
        self.ds_text = widgets.Textarea(layout=widgets.Layout(width="100%", height="220px"))
        self.ds_text.add_class("mpnb-panel-dsconfig")
        self.code_text = widgets.Textarea(layout=widgets.Layout(width="100%", height="320px"))
        self.code_text.add_class("mpnb-panel-code")
        self.ds_path = widgets.Text(value="ds_config.json", description="Save as", style=WIDE_LABELS)
        self.save_ds_button = widgets.Button(description="Save ds_config.json", icon="save")
        self.save_ds_button.add_class("mpnb-panel-save-ds")
        self.code_path = widgets.Text(value="mpnb_train.py", description="Save as", style=WIDE_LABELS)
        self.save_code_button = widgets.Button(description="Save code", icon="save")
        self.save_code_button.add_class("mpnb-panel-save-code")
        self.upload = widgets.FileUpload(accept=".json", multiple=False, description="Upload ds_config.json")
        self.upload.add_class("mpnb-panel-upload")
        self.import_path = widgets.Text(placeholder="path/to/ds_config.json", description="or path",
                                        style=WIDE_LABELS)
        self.load_button = widgets.Button(description="Load", icon="folder-open")
        self.load_button.add_class("mpnb-panel-load")
        self.io_message = widgets.HTML()
        self.io_message.add_class("mpnb-panel-io-message")
        self.upload.observe(self._on_upload, names="value")
        self.load_button.on_click(self._on_load_path)
        self.save_ds_button.on_click(lambda _: self._save(self.ds_path.value, self.ds_text.value))
        self.save_code_button.on_click(lambda _: self._save(self.code_path.value, self.code_text.value))

    def _files_tabs(self) -> tuple[widgets.Widget, widgets.Widget]:
        """(Export tab, Import tab)."""
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
        return export, importer

    def _show_export(self, cfg: Config | None) -> None:
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

    def load_deepspeed(self, ds: dict[str, Any] | str, source: str = "ds_config") -> Config | None:
        """Put a ds_config into the form (not applied yet). Returns the Config, or None with a message."""
        try:
            cfg = Config.from_deepspeed(ds, world_size=self.world_size())
            self._check_form_holds(cfg)
        except ConfigError as exc:
            self.io_message.value = ERROR_SPAN.format(html.escape(str(exc)))
            return None
        self._set_form(cfg)
        self.io_message.value = (f"Loaded {html.escape(source)}: {html.escape(cfg.summary())}. "
                                 "Check the estimate, then Apply.")
        self._refresh()
        return cfg

    def _check_form_holds(self, cfg: Config) -> None:
        """Raise ConfigError for a value a bounded number box would silently clamp."""
        for f in fields(cfg):
            box = getattr(self, f.name, None)
            value = getattr(cfg, f.name)
            if isinstance(box, widgets.BoundedIntText) and not box.min <= value <= box.max:
                raise ConfigError(f"{f.name}={value} is outside what the form takes ({box.min} to "
                                  f"{box.max}); fix the value in the file and load it again.")

    def _on_load_path(self, _button: Any = None) -> None:
        path = Path(self.import_path.value).expanduser()
        try:
            with path.open("rb") as fh:  # bounded: a wrong path may name a huge or endless file
                data = fh.read(MAX_DS_CONFIG_CHARS + 1)
        except OSError as exc:
            reason = html.escape(exc.strerror or str(exc))
            self.io_message.value = ERROR_SPAN.format(
                f"Cannot read {html.escape(str(path))}: {reason}. Check the path.")
            return
        self.load_deepspeed(data.decode("utf-8", errors="replace"), source=str(path))

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
            self.io_message.value = ERROR_SPAN.format(
                "Nothing to save: this config has no ds_config (see the code instead).")
            return
        path = Path(path_text).expanduser()
        try:
            path.write_text(content)
        except OSError as exc:
            self.io_message.value = ERROR_SPAN.format(
                f"Cannot write {html.escape(str(path))}: {html.escape(exc.strerror or str(exc))}.")
            return
        self.io_message.value = f"Saved {html.escape(str(path))} ({len(content.encode())} bytes)."
