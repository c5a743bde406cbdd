"""What the config panel plans for: the ranks, their device and memory, and the model.

With a live session the world size and device come from it and their inputs are
locked; without one the panel plans for whatever they say. Memory per rank is
entered in GiB (2**30 bytes), the unit the bars and every other mpnb view use.
"""

from __future__ import annotations

import html
import re
from typing import Any

import ipywidgets as widgets

from mpnb.errors import ConfigError
from mpnb.planning.hf_plans import attention_heads
from mpnb.planning.model_shape import shape_from_config
from mpnb.widgets.panel_style import NOTE_SPAN, WIDE_LABELS

GIB = 2**30
DEFAULT_CAPACITY_GIB = 80.0  # an 80 GB A100/H100, for planning without a cluster


def parse_count(text: str) -> int:
    """'124M', '7.5B', '1e9', '350,000' -> an int; ConfigError otherwise."""
    cleaned = str(text).strip().replace(",", "").replace("_", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)", cleaned)
    if not match:
        raise ConfigError(f"Cannot read the parameter count {text!r}; write e.g. 124M, 7.5B or 1e9.")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def requested_capacity(capacity_gib: float | None, capacity_gb: float | None) -> int | None:
    """Bytes per rank from either keyword: `capacity_gib` is binary, `capacity_gb` decimal (10**9 bytes)."""
    if capacity_gib is not None and capacity_gb is not None:
        raise ConfigError("Give the memory per rank once: capacity_gib (GiB, 2**30 bytes) or capacity_gb "
                          "(decimal GB, 10**9 bytes), not both.")
    if capacity_gib is not None:
        return int(capacity_gib * GIB)
    if capacity_gb is not None:
        return int(capacity_gb * 1e9)
    return None


def default_capacity(device_kind: str) -> int:
    """CPU ranks share the machine's memory (the monitor reports it as capacity); GPUs: an 80 GB card."""
    if device_kind == "cpu":
        import psutil

        return int(psutil.virtual_memory().total)
    return int(DEFAULT_CAPACITY_GIB * GIB)


class PlanInputs:
    """The world size, device, memory per rank and model inputs of `ConfigPanel`."""

    _session: Any  # the live session, or None while planning
    _model: Any  # an nn.Module, a parameter count, or None

    def _build_cluster(self, world_size: int | None, device_kind: str | None, capacity: int | None) -> None:
        sess = self._session
        world = sess.world_size if sess is not None else (world_size or 8)
        kind = sess.device_kind if sess is not None else (device_kind or "cuda")
        self.world = widgets.BoundedIntText(value=world, min=1, max=100_000, description="World size (ranks)",
                                            style=WIDE_LABELS, disabled=sess is not None)
        self.device = widgets.Dropdown(options=["cuda", "cpu"], value=kind, description="Device",
                                       style=WIDE_LABELS, disabled=sess is not None)
        if capacity is None:
            capacity = self._session_capacity() or default_capacity(kind)
        shown = round(capacity / GIB, 2)
        self.capacity_gib = widgets.BoundedFloatText(value=shown, min=0, max=1e6,
                                                     description="Memory per rank (GiB)", style=WIDE_LABELS)
        self.capacity_gib.add_class("mpnb-panel-capacity-input")
        # the field rounds for display; while it shows that value, the bytes given stay exact
        self._capacity_shown = (shown, capacity)
        where = "the running cluster" if sess is not None else "planning: no cluster running"
        self._cluster_note = widgets.HTML(NOTE_SPAN.format(where))

    def _session_capacity(self) -> int | None:
        if self._session is None:
            return None
        try:
            latest = self._session.memory.latest()
        except Exception:  # no monitor yet: fall back to the default
            return None
        caps = [int(s.get("capacity") or 0) for s in latest.values()]
        return max(caps) if caps and max(caps) > 0 else None

    def _build_model(self) -> None:
        model = self._model
        is_count = model is None or isinstance(model, int)
        self.num_params = widgets.Text(value=f"{model:,}" if isinstance(model, int) else "124M",
                                       description="Parameters", style=WIDE_LABELS)
        self.n_layer = widgets.BoundedIntText(value=12, min=0, max=10_000, description="Layers",
                                              style=WIDE_LABELS)
        self.hidden = widgets.BoundedIntText(value=768, min=0, max=1_000_000, description="Hidden size",
                                             style=WIDE_LABELS)
        self.n_head = widgets.BoundedIntText(value=12, min=0, max=10_000, description="Heads",
                                             style=WIDE_LABELS)
        self.vocab_size = widgets.BoundedIntText(value=50257, min=0, max=10_000_000, description="Vocabulary",
                                                 style=WIDE_LABELS)
        self.seq_len = widgets.BoundedIntText(value=1024, min=0, max=10_000_000,
                                              description="Sequence length", style=WIDE_LABELS)
        self.n_kv_head = widgets.BoundedIntText(value=12, min=0, max=10_000, description="Key/value heads",
                                                style=WIDE_LABELS)
        if is_count:
            rows = [self.num_params, self.n_layer, self.hidden, self.n_head, self.vocab_size, self.seq_len]
            title = "<b>Model (size and shape; 0 = unknown)</b>"
        else:
            count = sum(int(p.numel()) for p in {id(p): p for p in model.parameters()}.values())
            self.num_params.value = f"{count:,}"
            self.num_params.disabled = True
            shape = self._shape_rows(model)
            rows = [self.num_params, *shape, self.seq_len]
            title = f"<b>Model: {html.escape(type(model).__name__)}</b>"
            if shape:
                title += " " + NOTE_SPAN.format("shape read from its config")
        self._model_box = widgets.VBox([widgets.HTML(title), *rows])
        self._model_box.add_class("mpnb-panel-model")

    def _shape_rows(self, model: Any) -> list[widgets.Widget]:
        """The shape read from `model.config` (transformers or mpnb's GPT), shown read-only.

        The estimate reads the model itself; only the sequence length stays
        editable (it is a property of the batches, not the weights).
        """
        shape = shape_from_config(model)
        self.seq_len.value = int(shape.get("seq_len") or 0)
        if "n_layer" not in shape and "hidden" not in shape:
            return []  # no config: only the parameter count is known
        heads, kv_heads = attention_heads(model)
        values = {self.n_layer: shape.get("n_layer"), self.hidden: shape.get("hidden"), self.n_head: heads,
                  self.n_kv_head: kv_heads, self.vocab_size: shape.get("vocab")}
        for widget, value in values.items():
            widget.value = int(value or 0)
            widget.disabled = True
            widget.tooltip = "from the model's config"
        return list(values)

    def _plan_inputs(self) -> list[widgets.Widget]:
        return [self.world, self.device, self.capacity_gib, self.num_params, self.n_layer, self.hidden,
                self.n_head, self.vocab_size, self.seq_len]

    def world_size(self) -> int:
        return self._session.world_size if self._session is not None else int(self.world.value)

    def device_kind(self) -> str:
        return self._session.device_kind if self._session is not None else str(self.device.value)

    def capacity(self) -> int:
        """Memory per rank in bytes."""
        shown, exact = self._capacity_shown
        if self.capacity_gib.value == shown:
            return exact
        return int(self.capacity_gib.value * GIB)
