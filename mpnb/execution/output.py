"""Turning per-rank output into what a person wants to read.

Eight ranks printing the same loss must read as one line. `RankMerger` keeps
each rank's output as an ordered list of items (a stdout line, a stderr line,
a rich display) and emits an item once for every group of ranks that produced
it identically, labelled with those ranks; where ranks differ, each variant is
labelled with its own ranks. Ranks that lag a little are waited for
(`hold_s`), so identical lines still meet; a rank that prints alone is shown
after that short hold. The hold is measured on each rank's own clock, from
when its engine began the cell: a rank that began later (a busy engine, a
loaded machine) is waited for that much longer, up to `MAX_START_LAG_S`.

Carriage-return updates (tqdm) are not lines: the text after the last `\\r`
of an unfinished line is a rank's live *progress* line, shown in one display
that is updated in place; when the line ends, its final state becomes an item.

Pure logic, no IPython: `mpnb.execution` feeds it and renders what it returns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

LOOKAHEAD = 20  # items searched ahead when ranks disagree, to realign on a common line
MAX_START_LAG_S = 2.0  # the most a rank that began the cell late is waited for, on top of the hold
MAX_LINE_CHARS = 10_000  # characters a line keeps (`output_cap` cuts the rest, with a note)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def format_ranks(ranks: Sequence[int]) -> str:
    """[0] -> 'rank 0'; [0, 2] -> 'ranks 0,2'; [0, 1, 2, 3] -> 'ranks 0-3'; runs compressed."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    parts: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(
            str(start) if start == prev else f"{start}-{prev}" if prev > start + 1 else f"{start},{prev}"
        )
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


@dataclass(frozen=True)
class Item:
    """One thing a rank produced, in order: 'stdout' | 'stderr' (payload: a line) or 'display' (content)."""

    kind: str
    payload: Any

    def same_as(self, other: Item) -> bool:
        return self.kind == other.kind and self.payload == other.payload


@dataclass
class _RankStream:
    items: list[Item] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    cursor: int = 0
    began: float | None = None  # when its engine began the cell (None: not yet, or not known)
    finished: bool = False
    partial: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    progress: dict[str, str] = field(default_factory=dict)  # stream -> live \r line

    def next_item(self) -> Item | None:
        return self.items[self.cursor] if self.cursor < len(self.items) else None


class RankMerger:
    """Per-rank items in, (ranks, item) groups out; see the module docstring."""

    def __init__(self, ranks: Iterable[int], *, group: bool = True, hold_s: float = 0.3) -> None:
        self.streams = {r: _RankStream() for r in ranks}
        self.group = group
        self.hold_s = hold_s

    # -- input
    def add_text(self, rank: int, stream: str, text: str, now: float) -> None:
        s = self.streams[rank]
        buf = s.partial[stream] + text
        *lines, rest = buf.split("\n")
        for line in lines:
            self._add(rank, Item(stream, _final_state(line)), now)
        if len(rest) > MAX_LINE_CHARS and "\r" not in rest:
            self._add(rank, Item(stream, rest), now)
            rest = ""
        if "\r" in rest:  # a progress line redrawn in place: only its latest state matters (bounded)
            rest = "\r" + _final_state(rest) + ("\r" if rest.endswith("\r") else "")
        s.partial[stream] = rest
        live = _final_state(rest) if "\r" in rest else ""
        if live:
            s.progress[stream] = live
        else:
            s.progress.pop(stream, None)

    def began(self, rank: int, now: float) -> None:
        """The rank's engine began running the cell: its output is timed from here."""
        self.streams[rank].began = now

    def add_display(self, rank: int, content: dict[str, Any], now: float) -> None:
        self._add(rank, Item("display", content), now)

    def finish(self, rank: int, now: float) -> None:
        """The rank is done: its unfinished lines become items, its progress line ends."""
        s = self.streams[rank]
        for stream, rest in s.partial.items():
            if rest:
                self._add(rank, Item(stream, _final_state(rest)), now)
        s.partial = {"stdout": "", "stderr": ""}
        s.progress.clear()
        s.finished = True

    def _add(self, rank: int, item: Item, now: float) -> None:
        s = self.streams[rank]
        s.items.append(item)
        s.arrived.append(now)

    # -- output
    def progress(self) -> list[tuple[int, str]]:
        """Live progress lines, (rank, text), in rank order."""
        return [(r, text) for r, s in sorted(self.streams.items()) for text in s.progress.values()]

    def drain(self, now: float, final: bool = False) -> list[tuple[list[int], Item]]:
        """Items ready to show, each with the ranks that produced it identically."""
        out: list[tuple[list[int], Item]] = []
        if not self.group:
            for r, s in sorted(self.streams.items()):
                out.extend(([r], item) for item in s.items[s.cursor :])
                s.cursor = len(s.items)
            return out
        while True:
            pending = [r for r, s in self.streams.items() if s.next_item() is not None]
            if not pending:
                return out
            waiting = [r for r, s in self.streams.items() if s.next_item() is None and not s.finished]
            if waiting and not final and self._holding(pending, waiting, now):
                return out
            for ranks, item in self._choose_groups(pending):
                out.append((ranks, item))
                for r in ranks:
                    self.streams[r].cursor += 1

    def _holding(self, pending: list[int], waiting: list[int], now: float) -> bool:
        """Whether a waiting rank may still produce the pending items: it has not run for as long,
        on its own clock, as the pending rank had when its item came, plus the hold."""
        oldest = min(pending, key=lambda r: self.streams[r].arrived[self.streams[r].cursor])
        s = self.streams[oldest]
        lag = 0.0  # how much later than the pending rank the last waiting rank began (not yet: now)
        if s.began is not None:
            began = [self.streams[r].began for r in waiting]
            lag = max(now if b is None else b for b in began) - s.began
        return now - s.arrived[s.cursor] < self.hold_s + min(max(lag, 0.0), MAX_START_LAG_S)

    def _choose_groups(self, pending: list[int]) -> list[tuple[list[int], Item]]:
        groups: list[tuple[list[int], Item]] = []
        for r in sorted(pending):
            item = self.streams[r].next_item()
            assert item is not None
            for ranks, seen in groups:
                if seen.same_as(item):
                    ranks.append(r)
                    break
            else:
                groups.append(([r], item))
        if len(groups) == 1:
            return groups

        # Ranks disagree. Emit first the items the other ranks will not produce soon
        # (an extra line on one rank), so that the common lines after it still meet.
        # "Produce" compares lines with numbers masked: `value 1` on rank 1 is the
        # same line as `value 0` on rank 0, just with that rank's numbers.
        def coming_elsewhere(ranks: list[int], item: Item) -> bool:
            for r in pending:
                if r in ranks:
                    continue
                s = self.streams[r]
                if any(_alike(item, x) for x in s.items[s.cursor + 1 : s.cursor + 1 + LOOKAHEAD]):
                    return True
            return False

        extra = [g for g in groups if not coming_elsewhere(*g)]
        return extra if extra and len(extra) < len(groups) else groups


_NUMBER = re.compile(r"\d+(\.\d+)?")


def _alike(a: Item, b: Item) -> bool:
    if a.kind != b.kind:
        return False
    if a.kind == "display":
        return a.payload == b.payload
    return _NUMBER.sub("#", a.payload) == _NUMBER.sub("#", b.payload)


def _final_state(line: str) -> str:
    """What a terminal would show for a line with carriage returns: its last non-empty segment."""
    if "\r" not in line:
        return line
    segments = [seg for seg in line.split("\r") if seg]
    return segments[-1] if segments else ""


def group_equal(values: dict[int, Any]) -> list[tuple[list[int], Any]]:
    """{rank: value} -> [(ranks, value)] with equal values collapsed, in rank order."""
    groups: list[tuple[list[int], Any]] = []
    for r in sorted(values):
        for ranks, v in groups:
            if v == values[r]:
                ranks.append(r)
                break
        else:
            groups.append(([r], values[r]))
    return groups
