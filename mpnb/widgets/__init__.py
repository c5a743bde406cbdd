"""Kernel-side widgets: the config panel (`mpnb.widgets.panel.config_panel`), its estimate bars, and the
pipeline timeline. The memory chart is `mpnb.monitoring.chart`."""
