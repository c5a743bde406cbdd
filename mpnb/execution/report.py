"""What a finished cell tells the notebook: its values, its errors, and the story of what went wrong.

`DistributedResult` is the cell's `Out[n]` (one value per rank, collapsed where
equal). `CellFailedError` carries one `RankFailure` per distinct traceback;
`%load_ext mpnb` shows it as one block per failure (`CellFailedError.render`).
`story` puts into words what the supervisor saw: the rank that failed first,
releases, deaths, and where the ranks were.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mpnb.errors import RankError
from mpnb.execution.output import format_ranks, group_equal, strip_ansi


@dataclass
class RankFailure:
    ranks: list[int]
    ename: str
    evalue: str
    traceback: list[str]  # lines as the engine's IPython formatted them (ANSI colours kept)


class CellFailedError(RankError):
    """The cell raised on some ranks. Shown as one traceback per distinct error (see `render`)."""

    def __init__(
        self, failures: list[RankFailure], ran_on: list[int], note: str = "", stopped: Iterable[int] = ()
    ) -> None:
        self.failures = failures
        self.ran_on = ran_on
        self.note = note
        self.stopped = set(stopped)  # ranks mpnb interrupted to free them (released), not finished
        first = failures[0]
        super().__init__(f"{first.ename} on {format_ranks(first.ranks)}: {first.evalue}")

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(r for f in self.failures for r in f.ranks)

    def render(self) -> list[str]:
        """Structured traceback for IPython: one block per distinct error, labelled with its ranks."""
        lines: list[str] = []
        for f in self.failures:
            lines.append(f"\x1b[1;31m[{format_ranks(f.ranks)}]\x1b[0m {f.ename}: {f.evalue}")
            lines.extend(f.traceback)
            lines.append("")
        others = sorted(set(self.ran_on) - set(self.failed_ranks))
        finished = [r for r in others if r not in self.stopped]
        stopped = [r for r in others if r in self.stopped]
        ends = [f"{format_ranks(finished)} finished"] if finished else []
        ends += [f"{format_ranks(stopped)} interrupted by mpnb to free them"] if stopped else []
        summary = f"The cell failed on {format_ranks(self.failed_ranks)}{''.join(f'; {e}' for e in ends)}."
        if self.note:
            summary += " " + self.note
        lines.append(summary)
        return lines

    # IPython stores a failed cell's traceback in its history: through this, the short render, not
    # a formatting of mpnb's own frames (0.8 s on the first failure of a session, read from source)
    _render_traceback_ = render


class CellStopped(KeyboardInterrupt):
    """The stop button (or --timeout's interrupt) ended the cell where the ranks agreed to stop.

    Still a KeyboardInterrupt: the cell ends in error, so "Run All" stops there. `%load_ext mpnb`
    shows no traceback for it (nothing is wrong in mpnb or in the cell), and nothing at all when
    the cell's output already says where the ranks stopped (`said`): that is the stop's one line.
    """

    def __init__(self, ranks: list[int], said: bool) -> None:
        super().__init__(f"mpnb stopped {format_ranks(ranks)}")
        self.said = said

    def render(self) -> list[str]:
        return [] if self.said else [f"\x1b[1;31mKeyboardInterrupt\x1b[0m: {self}"]

    _render_traceback_ = render  # as CellFailedError's


class DistributedResult:
    """The cell's last-expression values: one per rank, shown collapsed where equal.

    Returned by `%%distributed` so the notebook shows it as `Out[n]`.
    `values` maps rank -> the engine's display data (a mime bundle).
    """

    def __init__(self, values: dict[int, dict[str, Any]]) -> None:
        self.values = values
        self.groups = group_equal(values)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if len(self.groups) == 1:  # every rank agrees: show it exactly as IPython would
            return dict(self.groups[0][1])
        text = "\n".join(
            f"[{format_ranks(ranks)}] {data.get('text/plain', '')}" for ranks, data in self.groups
        )
        bundle: dict[str, Any] = {"text/plain": text}
        if any("text/html" in data for _, data in self.groups):
            bundle["text/html"] = "".join(
                f"<div><b>[{format_ranks(ranks)}]</b> "
                f"{data.get('text/html') or _html_pre(data.get('text/plain', ''))}"
                "</div>"
                for ranks, data in self.groups
            )
        return bundle

    def __repr__(self) -> str:
        return self._repr_mimebundle_()["text/plain"]


def _html_pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


# ----------------------------------------------------------------------------- errors per rank


def error_content(exc: Exception) -> dict[str, Any]:
    """An exception from a rank's reply, as the `error` message content an engine would publish."""
    tb = getattr(exc, "traceback", None)
    return {
        "ename": getattr(exc, "ename", type(exc).__name__),
        "evalue": getattr(exc, "evalue", str(exc)),
        "traceback": tb.splitlines() if isinstance(tb, str) else list(tb or []),
    }


def is_engine_death(reply: Any) -> bool:
    """ipyparallel answers a dead engine's request with an EngineError (as an exception or a reply)."""
    if type(reply).__name__ == "EngineError" or getattr(reply, "ename", None) == "EngineError":
        return True
    content = reply.get("content", {}) if isinstance(reply, dict) else {}
    return isinstance(content, dict) and content.get("ename") == "EngineError"


_ENGINE_CELL = re.compile(r"(Cell(?:\x1b\[[0-9;]*m|\s)+In\[)\d+\]")  # colours sit between the words


def renumber(line: str, execution_count: int | None) -> str:
    """Engines count their own cells; name the notebook's cell instead so ranks' tracebacks match."""
    number = str(execution_count) if execution_count else " "
    return _ENGINE_CELL.sub(lambda m: m.group(1) + number + "]", line)


def group_errors(errors: dict[int, dict[str, Any]], execution_count: int | None) -> list[RankFailure]:
    """One `RankFailure` per distinct traceback (ignoring colours), in rank order."""
    by_text: dict[str, RankFailure] = {}
    for rank in sorted(errors):
        e = errors[rank]
        tb = [renumber(line, execution_count) for line in e.get("traceback") or []]
        key = strip_ansi("\n".join(tb)) or f"{e.get('ename')}: {e.get('evalue')}"
        if key in by_text:
            by_text[key].ranks.append(rank)
        else:
            by_text[key] = RankFailure([rank], e.get("ename", "Error"), e.get("evalue", ""), tb)
    return list(by_text.values())


# A rank blocked in a collective with a peer that died gets its transport's error: the death is the
# cause, already reported, and the survivor's traceback only says where it was waiting.
_LOST_PEER = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe")


def is_lost_peer(error: dict[str, Any] | None) -> bool:
    """An error that only says a peer's connection closed: the consequence of another rank's failure."""
    return error is not None and bool(_LOST_PEER.search(strip_ansi(str(error.get("evalue", "")))))


def broke_peers(errors: dict[int, dict[str, Any]], rank: int, reported_first: int) -> bool:
    """Whether `rank`'s own failure caused the lost-peer error `reported_first` sent in before it."""
    return is_lost_peer(errors.get(reported_first)) and not is_lost_peer(errors.get(rank))


def collapse_lost_peers(failures: list[RankFailure]) -> list[RankFailure]:
    """Failures caused by a dead rank's connections closing, as one line each naming the death."""
    dead = sorted(r for f in failures if f.ename == "RankDied" for r in f.ranks)
    if not dead:
        return failures
    out = []
    for f in failures:
        lost = _LOST_PEER.search(strip_ansi(f.evalue)) if f.ename != "RankDied" else None
        if lost:
            why = f"its collective broke off when {format_ranks(dead)} died ({lost.group(0)})"
            f = RankFailure(f.ranks, f.ename, why, [])
        out.append(f)
    return out


# ----------------------------------------------------------------------------- the story


def story(
    *,
    first_failed: int | None,
    errors: dict[int, dict[str, Any]],
    notes: list[str],
    stacks: dict[int, str],
    several_ranks: bool,
) -> list[str]:
    """What happened, for the message: first failure, releases, deaths, and where ranks were stuck."""
    lines = []
    if first_failed is not None and several_ranks:
        e = errors.get(first_failed, {})
        lines.append(
            f"{format_ranks([first_failed])} failed first: {e.get('ename', 'Error')}: {e.get('evalue')}"
        )
    lines.extend(notes)
    if stacks:
        lines.append("Where the ranks were (Python stacks, most recent call last):")
        lines.append(stack_text(stacks))
    return lines


def stack_text(stacks: dict[int, str]) -> str:
    """Each rank's stack under its label, in rank order."""
    return "\n".join(f"  [{format_ranks([r])}]\n{stacks[r]}" for r in sorted(stacks) if stacks[r])


def innermost(stack: str) -> str:
    """The cell line and the innermost frame of a formatted stack, for a one-line note."""
    lines = [ln.strip() for ln in stack.splitlines() if ln.strip() and not ln.strip().startswith("...")]
    cell = [line for line in lines if line.startswith("Cell In[")]
    return f"{cell[-1]} -> {lines[-1]}" if cell and cell[-1] != lines[-1] else (lines[-1] if lines else "?")
