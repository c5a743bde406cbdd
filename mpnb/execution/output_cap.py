"""The per-rank output caps: a rank that floods the cell shows its first output, a count, and its last lines.

A notebook slows to a crawl under a hundred thousand lines or a few hundred MiB
of output, and nobody reads them. Per rank and per cell:

- at most `MAX_LINES_PER_RANK` lines and `MAX_CHARS_PER_RANK` characters of
  text are shown; the rest is counted, and its last `TAIL_LINES` are kept to
  show after a note when the rank finishes, beside the output they stand for;
- a line keeps its first `MAX_LINE_CHARS` characters, then says how many more
  were cut (a line without a newline would otherwise be unbounded);
- at most `MAX_DISPLAYS_PER_RANK` rich displays (`display()`, figures) and
  `MAX_DISPLAY_CHARS_PER_RANK` characters of their data are shown; the rest
  is counted and named in a note.

Live progress (text after a carriage return, as tqdm writes it) is redrawn in
place, so only the final state of each line counts towards the cap. Sizes are
counted in characters (`len`, free for a str), a bound on bytes within the
4x of UTF-8.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any

from mpnb.execution.output import MAX_LINE_CHARS, RankMerger
from mpnb.units import format_bytes

MAX_LINES_PER_RANK = 1000  # lines of output shown per rank per cell; the rest is counted, not shown
TAIL_LINES = 10  # the last lines of a capped rank, shown after the note
# Characters of text shown per rank per cell. At the line cap a training log (lines of ~100-200
# characters) shows ~0.2 MiB, so 2 MiB leaves 10x room for long lines; 8 ranks with `--output all`
# then still write at most 16 MiB into the notebook, which it saves and renders.
MAX_CHARS_PER_RANK = 2 * 2**20
# Rich displays per rank per cell. A figure is ~20-100 KiB of base64 PNG: 8 MiB and 200 displays
# hold a figure per epoch of a long run; thousands of displays make a notebook unusable.
MAX_DISPLAYS_PER_RANK = 200
MAX_DISPLAY_CHARS_PER_RANK = 8 * 2**20


def _cut_note(cut: int) -> str:
    return f" [mpnb: {cut:,} more characters of this line not shown]"


@dataclass
class _Line:
    """The unfinished line of one stream of one rank: how much of it is kept and how much was cut."""

    col: int = 0  # characters kept since the last newline or carriage return
    width: int = 0  # the widest redraw kept of this line (what it shows at most)
    cut: int = 0  # characters of this line not kept


class OutputCap:
    """Text and displays shown and dropped per rank, and the last dropped lines."""

    def __init__(self) -> None:
        self._shown: dict[int, int] = {}  # rank -> lines shown
        self._chars: dict[int, int] = {}  # rank -> characters of finished lines shown
        self._capped: dict[int, str] = {}  # rank -> "lines" | "chars": which cap it reached first
        self._dropped: dict[int, int] = {}
        self._dropped_chars: dict[int, int] = {}
        self._tails: dict[int, deque[tuple[str, str]]] = {}
        self._lines: dict[tuple[int, str], _Line] = {}
        self._displays: dict[int, tuple[int, int]] = {}  # rank -> (displays, characters) shown
        self._dropped_displays: dict[int, tuple[int, int]] = {}

    def admit(self, rank: int, stream: str, text: str) -> str:
        """The part of `text` under this rank's caps, long lines cut; the rest is counted, its end kept."""
        if rank in self._capped:
            self._drop(rank, stream, text)
            return ""
        line = self._lines.get((rank, stream))
        if line is None:
            line = self._lines[rank, stream] = _Line()
        shown = self._shown.get(rank, 0)
        lines = text.count("\n")
        chars = self._chars.get(rank, 0)
        # The common case, in C: no redraw, no line too long, every cap far off.
        if (
            "\r" not in text
            and line.col + len(text) <= MAX_LINE_CHARS
            and lines <= MAX_LINES_PER_RANK - shown
            and chars + line.col + len(text) <= MAX_CHARS_PER_RANK
        ):
            self._shown[rank] = shown + lines
            if lines:
                self._chars[rank] = chars + line.col + text.rindex("\n") + 1
                line.col = line.width = len(text) - text.rindex("\n") - 1
            else:
                line.col += len(text)
                line.width = max(line.width, line.col)
            return text
        return self._admit_slowly(rank, stream, text, line)

    def _admit_slowly(self, rank: int, stream: str, text: str, line: _Line) -> str:
        """`admit` one line at a time: cut long lines, count redrawn lines once, stop at a cap."""
        out: list[str] = []
        pieces = text.split("\n")
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            if i < last:  # a line that ends here: is there room for one more?
                shown, chars = self._shown.get(rank, 0), self._chars.get(rank, 0)
                full = shown >= MAX_LINES_PER_RANK
                reason = "lines" if full else "chars" if chars >= MAX_CHARS_PER_RANK else ""
                if reason:
                    self._capped[rank] = reason
                    self._drop(rank, stream, "\n".join(pieces[i:]))
                    break
            out.append(self._keep(piece, line))
            if i == last:
                break  # the line goes on in a later message
            if line.cut:
                out.append(_cut_note(line.cut))
            out.append("\n")
            self._shown[rank] = shown + 1
            self._chars[rank] = chars + line.width + 1
            self._lines[rank, stream] = line = _Line()
        return "".join(out)

    @staticmethod
    def _keep(piece: str, line: _Line) -> str:
        """The part of `piece` (no newline in it) that keeps each redraw of the line under MAX_LINE_CHARS."""
        kept: list[str] = []
        for j, segment in enumerate(piece.split("\r")):
            if j:
                kept.append("\r")
                line.col = 0
            room = max(MAX_LINE_CHARS - line.col, 0)
            kept.append(segment[:room])
            line.cut += max(len(segment) - room, 0)
            line.col += min(len(segment), room)
            line.width = max(line.width, line.col)
        return "".join(kept)

    def _drop(self, rank: int, stream: str, text: str) -> None:
        self._dropped[rank] = self._dropped.get(rank, 0) + text.count("\n")
        self._dropped_chars[rank] = self._dropped_chars.get(rank, 0) + len(text)
        tail = self._tails.setdefault(rank, deque(maxlen=TAIL_LINES))
        for line in text.rsplit("\n", TAIL_LINES + 1)[-TAIL_LINES - 1 : -1]:
            cut = len(line) - MAX_LINE_CHARS
            tail.append((stream, line[:MAX_LINE_CHARS] + _cut_note(cut) if cut > 0 else line))

    def admit_display(self, rank: int, content: dict[str, Any]) -> bool:
        """Whether this rich display is still under the rank's display caps (else it is counted)."""
        count, chars = self._displays.get(rank, (0, 0))
        size = sum(len(v) if isinstance(v, str) else _json_size(v) for v in content.get("data", {}).values())
        if count < MAX_DISPLAYS_PER_RANK and chars + size <= MAX_DISPLAY_CHARS_PER_RANK:
            self._displays[rank] = (count + 1, chars + size)
            return True
        dropped, dropped_chars = self._dropped_displays.get(rank, (0, 0))
        self._dropped_displays[rank] = (dropped + 1, dropped_chars + size)
        return False

    def add_note(self, rank: int, merger: RankMerger, now: float) -> None:
        """If the rank was capped: its unfinished line, then the notes and the tail, into `merger`."""
        dropped, dropped_chars = self._dropped.get(rank, 0), self._dropped_chars.get(rank, 0)
        displays, display_chars = self._dropped_displays.get(rank, (0, 0))
        cuts = {s: line.cut for (r, s), line in self._lines.items() if r == rank and line.cut}
        capped = self._capped.get(rank)
        dropped_text = dropped if capped == "lines" else dropped_chars
        if not (dropped_text or displays or cuts):
            return
        for stream, cut in cuts.items():  # an unfinished line that was cut says so where it ends
            merger.add_text(rank, stream, _cut_note(cut), now)
        merger.finish(rank, now)  # its unfinished line first, then the notes
        merger.streams[rank].finished = False
        if displays:
            merger.add_text(
                rank,
                "stdout",
                f"mpnb: {displays:,} more displays ({format_bytes(display_chars)}) not shown (each rank "
                f"shows at most {MAX_DISPLAYS_PER_RANK:,} displays, "
                f"{format_bytes(MAX_DISPLAY_CHARS_PER_RANK)} of data, per cell; save figures to files, "
                "or show one at the end)\n",
                now,
            )
        if dropped_text:
            tail = self._tails.get(rank, ())
            if capped == "lines":
                note = (
                    f"mpnb: {dropped:,} more lines not shown (the first {MAX_LINES_PER_RANK:,} lines of each "
                    "rank are; write long logs to a file)"
                )
            else:
                note = (
                    f"mpnb: {dropped:,} more lines ({format_bytes(dropped_chars)}) not shown (the first "
                    f"{format_bytes(MAX_CHARS_PER_RANK)} of each rank's output are; write long logs to a "
                    "file)"
                )
            merger.add_text(
                rank,
                tail[0][0] if tail else "stdout",  # beside the lines it stands for
                note + (f"; the last {len(tail)}:" if tail else ".") + "\n",
                now,
            )
            for stream, line in tail:
                merger.add_text(rank, stream, line + "\n", now)


def _json_size(value: Any) -> int:
    try:
        return len(json.dumps(value, default=str))
    except (TypeError, ValueError, RecursionError):
        return 0
