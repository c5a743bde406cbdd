"""What the config panel's parts share: the label style and the markup of errors and notes."""

from __future__ import annotations

# labels at their natural width; at ipywidgets' default they are cut off
WIDE_LABELS = {"description_width": "initial"}
ERROR_HTML = '<div class="mpnb-panel-error" style="color:#c44e52">{}</div>'
ERROR_SPAN = '<span style="color:#c44e52">{}</span>'
NOTE_SPAN = '<span style="color:#777;font-size:11px">{}</span>'
