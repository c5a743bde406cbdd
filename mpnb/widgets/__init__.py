"""Kernel-side widgets: the config panel (`config_panel`). The memory chart lives in `mpnb.memory`."""

from __future__ import annotations

from mpnb.widgets.panel import ConfigPanel, config_panel

__all__ = ["ConfigPanel", "config_panel"]
