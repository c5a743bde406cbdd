"""Running one `%%distributed` cell on a set of ranks.

`CellRun` is a small state machine. It sends the cell to every chosen engine
as an ipyparallel execute request (one per rank, so each rank has its own
future), and registers an iopub callback *before* the request is sent, so no
output is lost and every engine's messages arrive in order. Callbacks run on
ipyparallel's IO thread and only put events on a queue; the kernel thread
takes events off the queue (waking at once, so an empty cell costs one round
trip), updates per-rank state and hands output to `CellRenderer`.

Per-rank states: running -> done | failed | stopped. The session's listeners
see every change (`Session.set_cell_state`). Extension points for stop/hang/
crash handling (issue 3): `_engine_code` (what runs on the engine), `_on_tick`
(called every TICK_S while ranks run), `_on_interrupt` and `_finish_rank`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpnb.errors import ConfigError, RankError
from mpnb.output import Item, RankMerger, format_ranks, group_equal, strip_ansi

if TYPE_CHECKING:
    from mpnb.cluster import Session

log = logging.getLogger("mpnb")

OUTPUT_MODES = ("grouped", "all", "rank0")
TICK_S = 0.05  # how often output is flushed and timeouts checked while ranks run
IDLE_GRACE_S = 2.0  # after a rank's reply, how long its trailing output may still arrive
INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long ranks get to return before being marked stopped
_cell_counter = itertools.count(1)


@dataclass
class CellOptions:
    ranks: list[int] | None = None  # None: every rank
    output: str = "grouped"
    quiet: bool = False
    timeout: float | None = None  # seconds; None: no bound
    monitor: bool = True

    def validate(self, world_size: int) -> None:
        if self.output not in OUTPUT_MODES:
            raise ConfigError(f"--output must be one of {', '.join(OUTPUT_MODES)}, not {self.output!r}.")
        if self.timeout is not None and not (self.timeout > 0 and self.timeout != float("inf")):
            raise ConfigError(f"--timeout must be a positive number of seconds, not {self.timeout!r}.")
        if self.ranks is not None:
            if not self.ranks:
                raise ConfigError("--ranks is empty. Give ranks like `--ranks 0,1`, or leave it out for all.")
            bad = [r for r in self.ranks if not 0 <= r < world_size]
            if bad:
                raise ConfigError(
                    f"Rank {', '.join(map(str, bad))} does not exist: "
                    f"this cluster has ranks 0-{world_size - 1}. "
                    "Pick ranks from that range."
                )
            if len(set(self.ranks)) != len(self.ranks):
                raise ConfigError(f"--ranks lists a rank twice ({self.ranks}). Give each rank once.")


def parse_ranks(text: str) -> list[int]:
    """'0,2' or '0-3' or '0,2-3' -> sorted ranks."""
    ranks: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = part.split("-", 1)
                ranks.extend(range(int(lo), int(hi) + 1))
            else:
                ranks.append(int(part))
    except ValueError:
        raise ConfigError(f"--ranks takes rank numbers like `0,2` or `0-3`, not {text!r}.") from None
    return ranks


# ----------------------------------------------------------------------------- results and errors


@dataclass
class RankFailure:
    ranks: list[int]
    ename: str
    evalue: str
    traceback: list[str]  # lines as the engine's IPython formatted them (ANSI colours kept)


class CellFailedError(RankError):
    """The cell raised on some ranks. Shown as one traceback per distinct error (see `render`)."""

    def __init__(self, failures: list[RankFailure], ran_on: list[int], note: str = "") -> None:
        self.failures = failures
        self.ran_on = ran_on
        self.note = note
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
        summary = f"The cell failed on {format_ranks(self.failed_ranks)}"
        summary += f"; {format_ranks(others)} finished." if others else "."
        if self.note:
            summary += " " + self.note
        lines.append(summary)
        return lines


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
                f"{data.get('text/html') or _html_escape(data.get('text/plain', ''))}"
                "</div>"
                for ranks, data in self.groups
            )
        return bundle

    def __repr__(self) -> str:
        return self._repr_mimebundle_()["text/plain"]


def _html_escape(text: str) -> str:
    import html

    return f"<pre>{html.escape(text)}</pre>"


# ----------------------------------------------------------------------------- rendering


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

    def wants(self, rank: int) -> bool:
        return not self.quiet and (self.mode != "rank0" or rank == self.first)

    def flush(self, now: float, final: bool = False) -> None:
        for ranks, item in self.merger.drain(now, final):
            self._emit(ranks, item)
        self._update_progress(final)

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


# ----------------------------------------------------------------------------- the state machine

RUNNING, DONE, FAILED, STOPPED = "running", "done", "failed", "stopped"


class CellRun:
    """One cell on some ranks, from submission to the last output."""

    def __init__(
        self,
        session: Session,
        code: str,
        options: CellOptions,
        execution_count: int | None = None,
        magic_line: str = "",
    ):
        options.validate(session.world_size)
        self.magic_line = magic_line
        self.session = session
        self.code = code
        self.options = options
        self.ranks = list(options.ranks) if options.ranks is not None else list(range(session.world_size))
        self.id = f"cell-{next(_cell_counter)}"
        self.execution_count = execution_count
        self.status = {r: RUNNING for r in self.ranks}
        self.results: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, dict[str, Any]] = {}
        self.renderer = CellRenderer(self.ranks, options.output, options.quiet)
        self._events: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        self._replied: dict[int, float] = {}
        self._idle: set[int] = set()
        self._futures: dict[int, Any] = {}
        self._started = 0.0
        self.timed_out = False
        self.interrupted = False

    # -- engine side
    def _engine_code(self) -> str:
        """The code each engine runs. The magic line, as a comment, makes engine line numbers match
        the notebook cell's (IPython would drop a blank line), so tracebacks point at the user's line."""
        return f"# %%distributed {self.magic_line}".rstrip() + "\n" + self.code

    # -- submission
    def submit(self) -> None:
        client = self.session.client
        code = self._engine_code()
        socket = client._mux_stream  # the stream, as DirectView uses: a raw-socket send can starve its reads
        for rank in self.ranks:
            idents, _ = client._build_targets(self.session.engine_id(rank))

            def hook(future: Any, rank: int = rank) -> None:
                # runs before the request is sent: nothing the engine publishes can be missed
                future.iopub_callbacks.append(lambda msg, rank=rank: self._on_iopub(rank, msg))
                future.add_done_callback(lambda f, rank=rank: self._events.put((rank, "reply", f.result())))
                future.output.add_done_callback(lambda f, rank=rank: self._events.put((rank, "idle", None)))

            self._futures[rank] = client.send_execute_request(
                socket,
                code,
                silent=False,
                ident=idents[0],
                metadata={"mpnb_cell": self.id},
                message_future_hook=hook,
            )
        self._started = time.monotonic()
        self._publish_state()

    def _on_iopub(self, rank: int, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        if kind in ("stream", "display_data", "execute_result", "error", "update_display_data"):
            self._events.put((rank, kind, msg["content"]))

    # -- the loop
    def wait(self) -> DistributedResult | None:
        """Process events until every rank has finished; raise `CellFailedError` if any failed."""
        try:
            while self._running():
                try:
                    self._drain_events(TICK_S)
                except KeyboardInterrupt:
                    self._on_interrupt()
                    raise
                self._on_tick()
        finally:
            self.renderer.flush(time.monotonic(), final=True)
        return self._conclude()

    def _running(self) -> bool:
        return any(s == RUNNING for s in self.status.values())

    def _drain_events(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._running():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                rank, kind, payload = self._events.get(timeout=remaining)
            except queue.Empty:
                return
            self._handle(rank, kind, payload)

    def _handle(self, rank: int, kind: str, payload: Any) -> None:
        now = time.monotonic()
        r = self.renderer
        if kind == "stream":
            if r.wants(rank):
                r.merger.add_text(rank, payload["name"], payload["text"], now)
        elif kind in ("display_data", "update_display_data"):
            if r.wants(rank):
                r.merger.add_display(rank, payload, now)
        elif kind == "execute_result":
            self.results[rank] = payload.get("data", {})
        elif kind == "error":
            self.errors[rank] = payload
        elif kind == "reply":
            self._replied[rank] = now
            if isinstance(payload, Exception) and rank not in self.errors:
                self.errors[rank] = _error_content(payload)
            if type(payload).__name__ == "EngineError":  # engine died: no more output will come
                self._idle.add(rank)
        elif kind == "idle":
            self._idle.add(rank)
        if rank in self._replied and rank in self._idle and self.status[rank] == RUNNING:
            self._finish_rank(rank, FAILED if rank in self.errors else DONE)

    def _finish_rank(self, rank: int, state: str) -> None:
        self.status[rank] = state
        self.renderer.merger.finish(rank, time.monotonic())
        self._publish_state()

    def _on_tick(self) -> None:
        now = time.monotonic()
        self.renderer.flush(now)
        for rank, t in self._replied.items():  # a reply whose idle status never came
            if self.status[rank] == RUNNING and now - t > IDLE_GRACE_S:
                self._finish_rank(rank, FAILED if rank in self.errors else DONE)
        if (
            self.options.timeout is not None
            and now - self._started > self.options.timeout
            and not self.timed_out
        ):
            self.timed_out = True
            self._stop_running_ranks()

    def _on_interrupt(self) -> None:
        """The notebook's stop button: interrupt running ranks, give them a moment, mark the rest stopped."""
        self.interrupted = True
        self._stop_running_ranks()

    def _stop_running_ranks(self) -> None:
        running = [r for r, s in self.status.items() if s == RUNNING]
        if not running:
            return
        try:
            self.session.client.send_signal(
                int(signal.SIGINT), targets=[self.session.engine_id(r) for r in running], block=False
            )
        except Exception:
            log.exception("mpnb: could not interrupt ranks %s", running)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while self._running() and time.monotonic() < deadline:
            try:
                self._drain_events(TICK_S)
            except KeyboardInterrupt:
                break  # a second interrupt: stop waiting
        for r in running:
            if self.status[r] == RUNNING:
                self._finish_rank(r, STOPPED)
            elif r in self.errors and self.errors[r].get("ename") == "KeyboardInterrupt":
                self.status[r] = STOPPED
        self._publish_state()

    # -- conclusion
    def _conclude(self) -> DistributedResult | None:
        self._publish_state(final=True)
        if self.timed_out:
            stopped = [r for r, s in self.status.items() if s == STOPPED]
            raise RankError(
                f"The cell ran longer than --timeout {self.options.timeout:g} s; "
                f"{format_ranks(stopped or self.ranks)} were interrupted. Raise --timeout, or check for "
                "ranks "
                "waiting on each other (a collective that only some ranks reach)."
            )
        real_errors = {r: e for r, e in self.errors.items() if self.status[r] == FAILED}
        if real_errors:
            raise CellFailedError(self._group_errors(real_errors), self.ranks)
        if not self.results or self.options.quiet:
            return None
        wanted = (
            self.results
            if self.options.output != "rank0"
            else {r: v for r, v in self.results.items() if r == self.ranks[0]}
        )
        return DistributedResult(wanted) if wanted else None

    def _group_errors(self, errors: dict[int, dict[str, Any]]) -> list[RankFailure]:
        by_text: dict[str, RankFailure] = {}
        for rank in sorted(errors):
            e = errors[rank]
            tb = [self._renumber(line) for line in e.get("traceback") or []]
            key = strip_ansi("\n".join(tb)) or f"{e.get('ename')}: {e.get('evalue')}"
            if key in by_text:
                by_text[key].ranks.append(rank)
            else:
                by_text[key] = RankFailure([rank], e.get("ename", "Error"), e.get("evalue", ""), tb)
        return list(by_text.values())

    def _renumber(self, line: str) -> str:
        """Engines count their own cells; name the notebook's cell instead so ranks' tracebacks match."""
        number = str(self.execution_count) if self.execution_count else " "
        return _ENGINE_CELL.sub(lambda m: m.group(1) + number + "]", line)

    def _publish_state(self, final: bool = False) -> None:
        states = set(self.status.values())
        if RUNNING in states and not final:
            overall = RUNNING
        elif FAILED in states or self.timed_out:
            overall = FAILED
        elif STOPPED in states:
            overall = STOPPED
        else:
            overall = DONE
        cell = {"id": self.id, "status": overall, "ranks": {str(r): s for r, s in self.status.items()}}
        if cell != self.session.cell:
            self.session.set_cell_state(cell)


_ENGINE_CELL = re.compile(r"(Cell(?:\x1b\[[0-9;]*m|\s)+In\[)\d+\]")  # colours sit between the words


def _error_content(exc: Exception) -> dict[str, Any]:
    tb = getattr(exc, "traceback", None)
    return {
        "ename": getattr(exc, "ename", type(exc).__name__),
        "evalue": getattr(exc, "evalue", str(exc)),
        "traceback": tb.splitlines() if isinstance(tb, str) else list(tb or []),
    }


def run_cell(
    session: Session,
    code: str,
    options: CellOptions | None = None,
    execution_count: int | None = None,
    magic_line: str = "",
) -> DistributedResult | None:
    """Run `code` on the chosen ranks, streaming output; raise `CellFailedError` if any rank raised."""
    run = CellRun(session, code, options or CellOptions(), execution_count, magic_line)
    chart = _memory_chart(session) if run.options.monitor and not run.options.quiet else None
    try:
        run.submit()
        return run.wait()
    finally:
        if chart is not None:
            try:
                chart.close()
            except Exception:
                log.exception("mpnb: closing the memory chart failed")


def _memory_chart(session: Session) -> Any:
    """The live memory chart under the cell, if the memory monitor is installed (mpnb.memory.cell_chart)."""
    try:
        from mpnb.memory import cell_chart
    except ImportError:
        return None
    try:
        return cell_chart(session)
    except Exception:
        log.exception("mpnb: the memory chart could not start; the cell runs without it")
        return None


def ranks_from_args(ranks: str | None, rank: int | None) -> list[int] | None:
    if ranks is not None and rank is not None:
        raise ConfigError("Give either --ranks or --rank, not both.")
    if rank is not None:
        return [rank]
    return parse_ranks(ranks) if ranks is not None else None


__all__: Sequence[str] = ["CellFailedError", "CellOptions", "CellRun", "DistributedResult", "run_cell"]
