"""Running one `%%distributed` cell on a set of ranks.

`CellRun` is a small state machine. It sends the cell to every chosen engine
as an ipyparallel execute request (one per rank, so each rank has its own
future), and registers an iopub callback *before* the request is sent, so no
output is lost and every engine's messages arrive in order. Callbacks run on
ipyparallel's IO thread and only put events on a queue; the kernel thread
takes events off the queue (waking at once, so an empty cell costs one round
trip), updates per-rank state (`mpnb.execution.states`) and hands output to
`CellRenderer` through the per-rank `OutputCap`.

The session's listeners see every state change (`Session.set_cell_state`).
What can go wrong while ranks run (deaths, hangs, a rank blocked on a failed
peer, the stop button, --timeout) is the `Supervisor`'s; what the notebook is
told at the end is built by `mpnb.execution.report`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mpnb.cluster import recovery, watchdog
from mpnb.engine.control import CELL_MARK, COLLECTIVE_MARK, STOP_NOTE
from mpnb.engine.quiet import VERBOSE_MARK
from mpnb.errors import RankError
from mpnb.execution import ipp_private
from mpnb.execution.options import CellOptions
from mpnb.execution.output import format_ranks
from mpnb.execution.output_cap import OutputCap
from mpnb.execution.render import CellRenderer
from mpnb.execution.report import (
    CellFailedError,
    CellStopped,
    DistributedResult,
    collapse_lost_peers,
    error_content,
    group_errors,
    is_engine_death,
    story,
)
from mpnb.execution.states import DONE, FAILED, RUNNING, STOPPED, overall_state
from mpnb.execution.supervisor import TICK_S, Supervisor

if TYPE_CHECKING:
    from mpnb.cluster.session import Session

log = logging.getLogger("mpnb")

OUTPUT_EVENTS = ("stream", "display_data", "update_display_data")  # what a rank shows in the cell
OUTPUT_BATCH_S = 0.003  # output from several ranks at once arrives within this: shown together
IDLE_GRACE_S = 2.0  # after a rank's reply, how long its trailing output may still arrive
_cell_counter = itertools.count(1)


class CellRun:
    """One cell on some ranks, from submission to the last output."""

    def __init__(
        self,
        session: Session,
        code: str,
        options: CellOptions,
        execution_count: int | None = None,
        magic_line: str = "",
        label: str | None = None,
    ):
        options.validate(session.world_size)
        self.magic_line = magic_line
        self.label = label  # what the sidebar names the run by (`%mpnb run`: the script's file name)
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
        self.output_cap = OutputCap()
        self.supervisor = Supervisor(self, options.timeout)
        self.started = 0.0
        self._events: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        self._replied: dict[int, float] = {}  # rank -> when its execute reply came
        self._idle: set[int] = set()  # ranks whose engine went idle (all their output is in)
        self._last_seen: dict[int, float] = {}  # rank -> when its last message arrived
        self._futures: dict[int, Any] = {}
        self.stop_said = False  # a rank's output shown in the cell says where it stopped (should_stop)
        self.tickers: list[Callable[[], None]] = []  # called every tick while ranks run (the memory chart)

    # -- engine side
    def _engine_code(self) -> str:
        """The code each engine runs. The magic line, as a comment, makes engine line numbers match
        the notebook cell's (IPython would drop a blank line), so tracebacks point at the user's line.
        The engine's pre_run_cell hook (`mpnb.engine.control`) reads it to reset the rank's stop state."""
        everyone = COLLECTIVE_MARK if len(self.ranks) == self.session.world_size else ""
        verbose = VERBOSE_MARK if self.options.verbose else ""  # read by mpnb.engine.quiet
        return f"{CELL_MARK} {self.magic_line}".rstrip() + everyone + verbose + "\n" + self.code

    # -- submission
    def submit(self) -> None:
        code = self._engine_code()
        for rank in self.ranks:

            def hook(future: Any, rank: int = rank) -> None:
                future.iopub_callbacks.append(lambda msg, rank=rank: self._on_iopub(rank, msg))
                future.add_done_callback(lambda f, rank=rank: self._events.put((rank, "reply", f.result())))
                future.output.add_done_callback(lambda f, rank=rank: self._events.put((rank, "idle", None)))

            self._futures[rank] = ipp_private.send_execute(
                self.session.client,
                self.session.engine_id(rank),
                code,
                metadata={"mpnb_cell": self.id},
                before_send=hook,
            )
        self.started = time.monotonic()
        self.publish_state()

    def _on_iopub(self, rank: int, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        if kind in (*OUTPUT_EVENTS, "execute_input", "execute_result", "error"):
            self._events.put((rank, kind, msg["content"]))
        if kind in ("stream", "display_data"):  # runs after ipyparallel stored its copy: drop it
            ipp_private.forget_output(self.session.client, msg)

    # -- the loop
    def wait(self) -> DistributedResult | None:
        """Process events until every rank has finished; raise `CellFailedError` if any failed."""
        stopped = False
        try:
            try:  # around the whole loop: the stop button's interrupt may land in its condition too
                while self.is_running():
                    self.drain_events(TICK_S)
                    self._on_tick()
            except KeyboardInterrupt:
                self.supervisor.interrupt()
                stopped = True
        finally:
            self.renderer.flush(time.monotonic(), final=True)
        if stopped:  # the stop button: say what happened, then fail the cell as an interrupt does
            self.publish_state(final=True)
            advice = recovery.advice(self.session) if recovery.needs(self.session) else ""
            lines = [line for line in [*self._story(), advice] if line]
            for line in lines:
                print(line, file=sys.stderr, flush=True)
            raise CellStopped(self.ranks, said=self.stop_said or bool(lines))
        return self._conclude()

    def is_running(self) -> bool:
        return any(s == RUNNING for s in self.status.values())

    def running_ranks(self) -> list[int]:
        return [r for r, s in self.status.items() if s == RUNNING]

    def drain_events(self, timeout: float) -> None:
        """Handle queued events for up to `timeout` seconds, returning early once no rank runs, and
        once output came and OUTPUT_BATCH_S passed without more: the caller shows it then, not at
        the next tick. A steady stream of output is still shown once per tick."""
        deadline = time.monotonic() + timeout
        output_came = False
        while self.is_running():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                wait = min(remaining, OUTPUT_BATCH_S) if output_came else remaining
                rank, kind, payload = self._events.get(timeout=wait)
            except queue.Empty:
                return
            self._handle(rank, kind, payload)
            output_came = output_came or kind in OUTPUT_EVENTS

    def flush_output(self, now: float) -> None:
        self.renderer.flush(now)

    def _handle(self, rank: int, kind: str, payload: Any) -> None:
        now = time.monotonic()
        self._last_seen[rank] = now
        if kind not in ("stream", "display_data", "update_display_data"):
            log.debug("rank %s: %s after %.2f s", rank, kind, now - self.started)
        r = self.renderer
        if kind == "stream":
            if r.wants(rank):
                text = self.output_cap.admit(rank, payload["name"], payload["text"])
                if text:
                    r.merger.add_text(rank, payload["name"], text, now)
                    self.stop_said = self.stop_said or STOP_NOTE in text
        elif kind in ("display_data", "update_display_data"):
            if r.wants(rank) and self.output_cap.admit_display(rank, payload):
                r.merger.add_display(rank, payload, now)
        elif kind == "execute_input":  # the engine began the cell: its output's clock starts here
            r.merger.began(rank, now)
        elif kind == "execute_result":
            self.results[rank] = payload.get("data", {})
        elif kind == "error":
            self.errors[rank] = payload
        elif kind == "reply":
            self._replied[rank] = now
            if isinstance(payload, Exception) and rank not in self.errors:
                self.errors[rank] = error_content(payload)
            if is_engine_death(payload):  # engine died: no more output will come
                self._idle.add(rank)
                if self.status[rank] == RUNNING:
                    self.supervisor.check_deaths(now, certain=[rank])
                    return
        elif kind == "idle":
            self._idle.add(rank)
        if rank in self._replied and rank in self._idle and self.status[rank] == RUNNING:
            self.finish_rank(rank, FAILED if rank in self.errors else DONE)

    def finish_rank(self, rank: int, state: str) -> None:
        supervisor = self.supervisor
        if state == DONE and (supervisor.interrupted or supervisor.timed_out):
            state = STOPPED  # it left because it was asked to (e.g. mpnb.should_stop())
        elif state == FAILED and self.errors.get(rank, {}).get("ename") == "KeyboardInterrupt":
            state = STOPPED
        self.status[rank] = state
        now = time.monotonic()
        self.output_cap.add_note(rank, self.renderer.merger, now)
        self.renderer.merger.finish(rank, now)
        supervisor.rank_finished(rank, state, now)
        self.publish_state()

    def mark_dead(self, rank: int, description: str, now: float) -> None:
        """The rank's engine is gone: it fails with `description`, and no more output will come."""
        self.errors[rank] = {"ename": "RankDied", "evalue": description, "traceback": []}
        self._idle.add(rank)
        self._replied.setdefault(rank, now)
        self.finish_rank(rank, FAILED)

    def _on_tick(self) -> None:
        now = time.monotonic()
        self.renderer.flush(now)
        for tick in list(self.tickers):
            try:
                tick()
            except Exception:
                log.exception("mpnb: a cell ticker failed")
                self.tickers.remove(tick)
        for rank, t in self._replied.items():  # a reply whose idle status never came
            quiet_since = max(t, self._last_seen.get(rank, t))  # output still flowing: the engine lags
            if self.status[rank] == RUNNING and now - quiet_since > IDLE_GRACE_S:
                self.finish_rank(rank, FAILED if rank in self.errors else DONE)
        self.supervisor.tick(now)

    # -- conclusion
    def _conclude(self) -> DistributedResult | None:
        self.publish_state(final=True)
        advice = recovery.advice(self.session) if recovery.needs(self.session) else ""
        if self.supervisor.timed_out:
            stopped = [r for r, s in self.status.items() if s != DONE]
            msg = (
                f"The cell ran longer than --timeout {self.options.timeout:g} s; "
                f"{format_ranks(stopped or self.ranks)} did not finish in time. Raise --timeout, or check "
                "for ranks waiting on each other (a collective that only some ranks reach)."
            )
            raise RankError("\n".join([msg, *self._story(), advice]).strip())
        real_errors = {r: e for r, e in self.errors.items() if self.status[r] == FAILED}
        if real_errors:
            note = "\n".join([*self._story(), advice]).strip()
            failures = collapse_lost_peers(group_errors(real_errors, self.execution_count))
            first_failure = self.supervisor.first_failure
            if first_failure is not None:  # the cause first, the ranks it took down after
                first = first_failure[0]
                failures.sort(key=lambda f: first not in f.ranks)
            stopped = [r for r, s in self.status.items() if s == STOPPED]
            raise CellFailedError(failures, self.ranks, note=note, stopped=stopped)
        if not self.results or self.options.quiet:
            return None
        wanted = (
            self.results
            if self.options.output != "rank0"
            else {r: v for r, v in self.results.items() if r == self.ranks[0]}
        )
        return DistributedResult(wanted) if wanted else None

    def _story(self) -> list[str]:
        supervisor = self.supervisor
        dead = {d.rank for d in supervisor.deaths}
        idle = [r for r, s in self.status.items() if s != RUNNING and r not in dead]
        read = watchdog.read_back(self.session, supervisor.stacks, idle, self.execution_count)
        supervisor.stacks.update(read)  # ranks on other hosts: through their engines, idle by now
        first = supervisor.first_failure
        return story(
            first_failed=first[0] if first is not None else None,
            errors=self.errors,
            notes=supervisor.notes,
            stacks=supervisor.stacks,
            several_ranks=len(self.ranks) > 1,
        )

    def publish_state(self, final: bool = False) -> None:
        overall = overall_state(self.status.values(), timed_out=self.supervisor.timed_out, final=final)
        ranks = {str(r): s for r, s in self.status.items()}
        cell: dict[str, Any] = {"id": self.id, "status": overall, "ranks": ranks}
        if self.label is not None:
            cell["label"] = self.label
        if cell != self.session.cell:
            self.session.set_cell_state(cell)


def run_cell(
    session: Session,
    code: str,
    options: CellOptions | None = None,
    execution_count: int | None = None,
    magic_line: str = "",
    label: str | None = None,
) -> DistributedResult | None:
    """Run `code` on the chosen ranks, streaming output; raise `CellFailedError` if any rank raised.

    `label` (e.g. a script's file name) goes into the published cell state for the sidebar."""
    recovery.check_ready(session)  # after a crash or release: say whether to heal or restart, before sending
    session.wait_until_warm()
    run = CellRun(session, code, options or CellOptions(), execution_count, magic_line, label)
    chart = _memory_chart(session) if run.options.monitor and not run.options.quiet else None
    if chart is not None:
        run.tickers.append(chart.tick)
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
    """The live memory chart under the cell (`mpnb.monitoring.chart.cell_chart`), or None if it fails."""
    from mpnb.monitoring.chart import cell_chart

    try:
        return cell_chart(session)
    except Exception:
        log.exception("mpnb: the memory chart could not start; the cell runs without it")
        return None


__all__: Sequence[str] = ["CellOptions", "CellRun", "run_cell"]
