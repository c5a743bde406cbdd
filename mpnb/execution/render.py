"""Writing a cell's merged output into the notebook: labelled lines, rich displays, live progress.

`RankMerger` (mpnb.execution.output) decides what to show and for which ranks;
this module turns that into stdout/stderr writes and display messages of the
kernel, so the notebook sees the cell's output as it happens.
"""

from __future__ import annotations

import sys
import time

from mpnb.execution.output import Item, RankMerger, format_ranks

PROGRESS_INTERVAL_S = 0.08  # live progress (tqdm) redrawn at most this often: over 10 Hz, as a terminal


class CellRenderer:
    """Writes merged output into the notebook: labelled lines, rich displays, live progress."""

    def __init__(self, ranks: list[int], mode: str, quiet: bool) -> None:
        self.mode = mode
        self.quiet = quiet
        self.first = ranks[0]
        self.labelled = len(ranks) > 1 and mode != "rank0"
        self.merger = RankMerger(ranks, group=mode == "grouped")
        self._progress_id: str | None = None
        self._progress_shown = ""
        self._progress_at = 0.0

    def wants(self, rank: int) -> bool:
        return not self.quiet and (self.mode != "rank0" or rank == self.first)

    def flush(self, now: float, final: bool = False) -> None:
        # Consecutive lines of one stream go out as one write: one message to the notebook, not one per line.
        pending: list[str] = []
        kind = ""
        for ranks, item in self.merger.drain(now, final):
            if item.kind in ("stdout", "stderr"):
                if item.kind != kind:
                    self._write(kind, pending)
                    kind = item.kind
                pending.append(f"{self._label(ranks)}{item.payload}\n")
            else:
                self._write(kind, pending)
                self._emit(ranks, item)
        self._write(kind, pending)
        if final or now - self._progress_at >= PROGRESS_INTERVAL_S:
            self._progress_at = now
            self._update_progress(final)

    @staticmethod
    def _write(kind: str, lines: list[str]) -> None:
        if lines:
            stream = sys.stdout if kind == "stdout" else sys.stderr
            stream.write("".join(lines))
            stream.flush()
            lines.clear()

    def _label(self, ranks: list[int]) -> str:
        return f"[{format_ranks(ranks)}] " if self.labelled else ""

    def _emit(self, ranks: list[int], item: Item) -> None:
        if item.kind in ("stdout", "stderr"):
            stream = sys.stdout if item.kind == "stdout" else sys.stderr
            stream.write(f"{self._label(ranks)}{item.payload}\n")
            stream.flush()
            return
        from IPython.display import publish_display_data

        content = item.payload
        data = {
            k: v
            for k, v in content.get("data", {}).items()
            if not k.startswith("application/vnd.jupyter.widget")
        }
        if not data:
            return
        if self.labelled:
            sys.stdout.write(f"[{format_ranks(ranks)}]\n")
            sys.stdout.flush()
        publish_display_data(data, metadata=content.get("metadata") or {})

    def _update_progress(self, final: bool) -> None:
        lines = [] if final else [f"{self._label([r])}{text}" for r, text in self.merger.progress()]
        text = "\n".join(lines)
        if text == self._progress_shown:
            return
        from IPython.display import publish_display_data

        update = self._progress_id is not None
        if not update:
            self._progress_id = f"mpnb-progress-{time.monotonic_ns()}"
        publish_display_data({"text/plain": text}, transient={"display_id": self._progress_id}, update=update)
        self._progress_shown = text
