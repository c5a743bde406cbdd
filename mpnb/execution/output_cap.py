"""The per-rank line cap: a rank that floods the cell shows its first lines, a count, and its last lines.

A notebook slows to a crawl under a hundred thousand lines, and nobody reads
them. Each rank shows at most `MAX_LINES_PER_RANK` lines per cell; the rest is
counted, and its last `TAIL_LINES` are kept to show after a note when the rank
finishes, beside the output they stand for.
"""

from __future__ import annotations

from collections import deque

from mpnb.execution.output import RankMerger

MAX_LINES_PER_RANK = 1000  # lines of output shown per rank per cell; the rest is counted, not shown
TAIL_LINES = 10  # the last lines of a capped rank, shown after the note


class OutputCap:
    """Lines shown and dropped per rank, and the last dropped lines."""

    def __init__(self) -> None:
        self._shown: dict[int, int] = {}
        self._dropped: dict[int, int] = {}
        self._tails: dict[int, deque[tuple[str, str]]] = {}

    def admit(self, rank: int, stream: str, text: str) -> str:
        """The part of `text` still under this rank's line cap; the rest is counted and its end kept."""
        shown = self._shown.get(rank, 0)
        room = MAX_LINES_PER_RANK - shown
        lines = text.count("\n")
        if lines <= room:
            self._shown[rank] = shown + lines
            return text
        cut = -1
        for _ in range(max(room, 0)):
            cut = text.index("\n", cut + 1)
        keep, rest = text[: cut + 1], text[cut + 1 :]
        self._shown[rank] = MAX_LINES_PER_RANK
        self._dropped[rank] = self._dropped.get(rank, 0) + rest.count("\n")
        tail = self._tails.setdefault(rank, deque(maxlen=TAIL_LINES))
        tail.extend((stream, line) for line in rest.rsplit("\n", TAIL_LINES + 1)[-TAIL_LINES - 1 : -1])
        return keep

    def add_note(self, rank: int, merger: RankMerger, now: float) -> None:
        """If the rank was capped: its unfinished line, then the note and the tail, into `merger`."""
        dropped = self._dropped.get(rank, 0)
        if not dropped:
            return
        merger.finish(rank, now)  # its unfinished line first, then the note
        merger.streams[rank].finished = False
        tail = self._tails.get(rank, ())
        merger.add_text(
            rank,
            tail[0][0] if tail else "stdout",  # beside the lines it stands for
            f"mpnb: {dropped:,} more lines not shown (the first {MAX_LINES_PER_RANK:,} lines of each "
            "rank are; write long logs to a file)" + (f"; the last {len(tail)}:" if tail else ".") + "\n",
            now,
        )
        for stream, line in tail:
            merger.add_text(rank, stream, line + "\n", now)
