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

Robustness (see docs/internals.md, "Recovery model"): every tick the run checks
for dead ranks (`mpnb.watchdog`), for a rank that failed while others still run
(after FAIL_GRACE_S it dumps the others' stacks and destroys the process group
on the finished ranks, which releases peers blocked in a collective at once),
and for a hang (some ranks finished, others stuck in a collective). Output is
capped per rank, with a note of what was dropped and the last lines.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpnb.cluster import recovery, watchdog
from mpnb.errors import ConfigError, RankError
from mpnb.execution.output import Item, RankMerger, format_ranks, group_equal, strip_ansi

if TYPE_CHECKING:
    from mpnb.cluster.session import Session

log = logging.getLogger("mpnb")

OUTPUT_MODES = ("grouped", "all", "rank0")
TICK_S = 0.05  # how often output is flushed and timeouts checked while ranks run
IDLE_GRACE_S = 2.0  # after a rank's reply, how long its trailing output may still arrive
INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long ranks get to return before a hard stop
HARD_STOP_GRACE_S = 3.0  # after the hard stop, how long before ranks still busy are marked stopped
FAIL_GRACE_S = 0.5  # a rank failed: how long the others may still finish on their own before release
RELEASE_GRACE_S = 7.0
LATE_SIGINT_S = 2.0  # after a release, when ranks of unknown whereabouts still running get SIGINT
DEATH_CHECK_S = 0.25  # how often running ranks' processes are checked
MAX_LINES_PER_RANK = 1000  # lines of output shown per rank per cell; the rest is counted, not shown
TAIL_LINES = 10  # the last lines of a capped rank, shown after the note
PROGRESS_INTERVAL_S = 0.2  # live progress (tqdm) redrawn at most this often
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
        # robustness: what went wrong, in order, and what the notebook is told about it
        self.notes: list[str] = []
        self.stacks: dict[int, str] = {}  # rank -> where it was stuck (faulthandler)
        self.deaths: list[watchdog.Death] = []
        self.first_failure: tuple[int, float] | None = None
        self.released = False  # the process group was destroyed to free waiting ranks
        self._release_at: float | None = None
        self._last_seen: dict[int, float] = {}  # rank -> when its last message arrived
        self._late_sigint: list[int] = []  # released ranks whose stack was unknown: SIGINT if still running
        self._next_death_check = 0.0
        self._partial_since: float | None = None  # some ranks finished while others still run
        self._hang_checked = False
        # output cap: lines shown per rank, lines dropped, and the last dropped lines
        self._shown_lines: dict[int, int] = {}
        self._dropped: dict[int, int] = {}
        self._tails: dict[int, deque[tuple[str, str]]] = {}

    # -- engine side
    def _engine_code(self) -> str:
        """The code each engine runs. The magic line, as a comment, makes engine line numbers match
        the notebook cell's (IPython would drop a blank line), so tracebacks point at the user's line.
        The engine's pre_run_cell hook (`mpnb.engine.control`) reads it to reset the rank's stop state."""
        from mpnb.engine.control import CELL_MARK, COLLECTIVE_MARK

        everyone = COLLECTIVE_MARK if len(self.ranks) == self.session.world_size else ""
        return f"{CELL_MARK} {self.magic_line}".rstrip() + everyone + "\n" + self.code

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
        stopped = False
        try:
            while self._running():
                try:
                    self._drain_events(TICK_S)
                    self._on_tick()
                except KeyboardInterrupt:
                    self._on_interrupt()
                    stopped = True
                    break
        finally:
            self.renderer.flush(time.monotonic(), final=True)
        if stopped:  # the stop button: say what happened, then fail the cell as an interrupt does
            self._publish_state(final=True)
            advice = recovery.advice(self.session) if recovery.needs(self.session) else ""
            for line in [*self._story(), advice]:
                if line:
                    print(line, file=sys.stderr, flush=True)
            raise KeyboardInterrupt(f"mpnb stopped {format_ranks(self.ranks)}")
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
        self._last_seen[rank] = now
        if kind not in ("stream", "display_data", "update_display_data"):
            log.debug("rank %s: %s after %.2f s", rank, kind, now - self._started)
        r = self.renderer
        if kind == "stream":
            if r.wants(rank):
                text = self._cap(rank, payload["name"], payload["text"])
                if text:
                    r.merger.add_text(rank, payload["name"], text, now)
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
            if _is_engine_death(payload):  # engine died: no more output will come
                self._idle.add(rank)
                if self.status[rank] == RUNNING:
                    self._check_deaths(now, certain=[rank])
                    return
        elif kind == "idle":
            self._idle.add(rank)
        if rank in self._replied and rank in self._idle and self.status[rank] == RUNNING:
            self._finish_rank(rank, FAILED if rank in self.errors else DONE)

    def _cap(self, rank: int, stream: str, text: str) -> str:
        """The part of `text` still under this rank's line cap; the rest is counted and its end kept."""
        shown = self._shown_lines.get(rank, 0)
        room = MAX_LINES_PER_RANK - shown
        lines = text.count("\n")
        if lines <= room:
            self._shown_lines[rank] = shown + lines
            return text
        cut = -1
        for _ in range(max(room, 0)):
            cut = text.index("\n", cut + 1)
        keep, rest = text[: cut + 1], text[cut + 1 :]
        self._shown_lines[rank] = MAX_LINES_PER_RANK
        self._dropped[rank] = self._dropped.get(rank, 0) + rest.count("\n")
        tail = self._tails.setdefault(rank, deque(maxlen=TAIL_LINES))
        tail.extend((stream, line) for line in rest.rsplit("\n", TAIL_LINES + 1)[-TAIL_LINES - 1 : -1])
        return keep

    def _finish_rank(self, rank: int, state: str) -> None:
        if state == DONE and (self.interrupted or self.timed_out):
            state = STOPPED  # it left because it was asked to (e.g. mpnb.should_stop())
        elif state == FAILED and self.errors.get(rank, {}).get("ename") == "KeyboardInterrupt":
            state = STOPPED
        self.status[rank] = state
        now = time.monotonic()
        dropped = self._dropped.get(rank, 0)
        if dropped:
            merger = self.renderer.merger
            merger.finish(rank, now)  # its unfinished line first, then the note
            merger.streams[rank].finished = False
            tail = self._tails.get(rank, ())
            merger.add_text(
                rank,
                tail[0][0] if tail else "stdout",  # beside the lines it stands for
                f"mpnb: {dropped:,} more lines not shown (the first {MAX_LINES_PER_RANK:,} lines of each "
                "rank are; write long logs to a file)"
                + (f"; the last {len(tail)}:" if tail else ".")
                + "\n",
                now,
            )
            for stream, line in tail:
                merger.add_text(rank, stream, line + "\n", now)
        self.renderer.merger.finish(rank, now)
        if state == FAILED and self.first_failure is None and self._running():
            self.first_failure = (rank, now)
        if state == DONE and self._partial_since is None and self._running():
            self._partial_since = now
        self._publish_state()

    def _on_tick(self) -> None:
        now = time.monotonic()
        self.renderer.flush(now)
        for rank, t in self._replied.items():  # a reply whose idle status never came
            quiet_since = max(t, self._last_seen.get(rank, t))  # output still flowing: the engine lags
            if self.status[rank] == RUNNING and now - quiet_since > IDLE_GRACE_S:
                self._finish_rank(rank, FAILED if rank in self.errors else DONE)
        if now >= self._next_death_check and self._running():
            self._next_death_check = now + DEATH_CHECK_S
            self._check_deaths(now)
        failure = self.first_failure
        if failure is not None and not self.released and self._running() and now - failure[1] >= FAIL_GRACE_S:
            self._release(f"{format_ranks([failure[0]])} failed")
        since = self._partial_since
        hang_due = since is not None and now - since >= self._hang_after()
        if hang_due and not self._hang_checked and self._running():
            self._check_hang(now)
        if self._late_sigint and self._release_at is not None and now - self._release_at > LATE_SIGINT_S:
            self._signal([r for r in self._late_sigint if self.status[r] == RUNNING], signal.SIGINT)
            self._late_sigint = []
        if self._release_at is not None and now - self._release_at > RELEASE_GRACE_S:
            self._release_at = None
            self._give_up_on_running("did not return after the others were released")
        if (
            self.options.timeout is not None
            and now - self._started > self.options.timeout
            and not self.timed_out
        ):
            self.timed_out = True
            self._stop_running_ranks(reason="timeout")

    def _hang_after(self) -> float:
        """Seconds a rank may run on alone before the watchdog looks at its stack."""
        return min(10.0, max(2.0, self.session.timeout / 3))

    def _running_ranks(self) -> list[int]:
        return [r for r, s in self.status.items() if s == RUNNING]

    def _check_deaths(self, now: float, certain: Sequence[int] = ()) -> None:
        """Ranks whose engine is gone fail with rank, host and signal; survivors are released."""
        deaths = watchdog.dead_ranks(self.session, self._running_ranks())
        for r in certain:  # the controller already said so: the cause may not be readable yet
            if r not in [d.rank for d in deaths] and self.status[r] == RUNNING:
                info = self.session.ranks[r]
                cause = watchdog.exit_cause(info.pid, self.session) if watchdog.is_local(info) else None
                deaths.append(watchdog.Death(r, info.host, info.pid, cause or "died (its engine is gone)"))
        if not deaths:
            return
        for d in deaths:
            self.deaths.append(d)
            self.errors[d.rank] = {"ename": "RankDied", "evalue": d.describe(), "traceback": []}
            self._idle.add(d.rank)
            self._replied.setdefault(d.rank, now)
            self._finish_rank(d.rank, FAILED)
        if self.first_failure is None or self.first_failure[0] not in [d.rank for d in deaths]:
            self.first_failure = (deaths[0].rank, now)
        recovery.mark(self.session, "restart", "; ".join(d.describe() for d in deaths))
        oom = any("SIGKILL" in d.cause for d in deaths)
        self.notes.append(
            "Lost "
            + "; ".join(d.describe() for d in deaths)
            + (" (out of memory? the OOM killer sends SIGKILL)." if oom else ".")
        )
        if self._running():
            self._release(f"{format_ranks([d.rank for d in deaths])} died")

    def _check_hang(self, now: float) -> None:
        """Some ranks finished long ago; if the others wait in a collective, nobody will ever join them."""
        self._hang_checked = True
        running = self._running_ranks()
        stacks = watchdog.dump_stacks(self.session, running, self.execution_count)
        self.stacks.update(stacks)
        waiting = [r for r in running if watchdog.in_collective(stacks.get(r, ""))]
        finished = [r for r, s in self.status.items() if s != RUNNING]
        if waiting:
            self.notes.append(
                f"Hang: {format_ranks(waiting)} waited {now - (self._partial_since or now):.0f} s in a "
                f"collective after {format_ranks(finished)} finished the cell: a collective that only some "
                "ranks reach (e.g. under `if rank == 0`)."
            )
            self._release("a hang", stacks_known=True)
        elif any(stacks.values()):
            alone = now - (self._partial_since or now)
            print(
                f"mpnb: {format_ranks(running)} still running {alone:.0f} s after "
                f"{format_ranks(finished)} finished; now at:\n" + _stack_text(stacks),
                file=sys.stderr,
                flush=True,
            )

    def _release(self, cause: str, stacks_known: bool = False) -> None:
        """Free ranks still running after a failure: stacks, then end the group, then SIGINT the rest."""
        running = self._running_ranks()
        if not running:
            return
        log.debug("release after %s at %.2f s", cause, time.monotonic() - self._started)
        if not stacks_known:
            self.stacks.update(watchdog.dump_stacks(self.session, running, self.execution_count))
        dead = {d.rank for d in self.deaths}
        alive_ids = set(self.session.client.ids)
        finished = [
            r
            for r, s in self.status.items()
            if s != RUNNING and r not in dead and self.session.engine_id(r) in alive_ids
        ]
        from mpnb.engine import control  # only its functions travel; the module imports no torch at load

        if finished:
            try:
                peers: dict[str, list[int]] = {}
                for info in self.session.ranks:
                    peers.setdefault(info.host, []).append(info.pid)
                ar = self.session.view(finished).apply_async(control.release_peers, peers)
                ar.add_done_callback(lambda f: log.debug("group ended on %s: %s", finished, f.exception()))
            except Exception:
                log.exception("mpnb: could not release the process group on %s", finished)
        self.released = True
        need = "restart" if self.deaths else "heal"
        recovery.mark(self.session, need, f"the process group was torn down after {cause}")
        # Ranks inside a collective are freed by the group's end; a SIGINT now would replace their
        # informative "connection closed" error. The others (pure Python) get interrupted.
        # A rank already formatting its error is left alone; one whose stack is unknown gets SIGINT later.
        stacks = {r: self.stacks.get(r, "") for r in running}
        python = [
            r
            for r in running
            if stacks[r] and not watchdog.in_collective(stacks[r]) and not watchdog.is_reporting(stacks[r])
        ]
        self._signal(python, signal.SIGINT)
        self._late_sigint = [r for r in running if not stacks[r]]
        waiting = [r for r in running if r not in python]
        where = "; ".join(f"{format_ranks([r])} was in {_innermost(self.stacks[r])}" for r in waiting)
        self.notes.append(
            f"After {cause}, mpnb released {format_ranks(running)}"
            + (f" ({where})" if where else "")
            + " by ending the process group on the ranks that had finished."
        )
        self._release_at = time.monotonic()

    def _signal(self, ranks: list[int], sig: int) -> None:
        if not ranks:
            return
        try:
            self.session.client.send_signal(
                int(sig), targets=[self.session.engine_id(r) for r in ranks], block=False
            )
        except Exception:
            log.exception("mpnb: could not signal ranks %s", ranks)

    def _give_up_on_running(self, why: str) -> None:
        running = self._running_ranks()
        if not running:
            return
        stacks = watchdog.dump_stacks(self.session, running, self.execution_count)
        self.stacks.update(stacks)
        for r in running:
            self._finish_rank(r, STOPPED)
        recovery.mark(
            self.session,
            "restart" if self.deaths else "heal" if self.released else "wait",
            f"{format_ranks(running)} {why} and may still be busy (blocked in C code)",
            busy=running,
        )
        self.notes.append(
            f"{format_ranks(running)} {why}; still busy at:\n{_stack_text(stacks)}\n"
            f"It returns at the process-group timeout ({self.session.timeout:g} s)."
        )

    def _on_interrupt(self) -> None:
        """The notebook's stop button: interrupt running ranks, give them a moment, mark the rest stopped."""
        self.interrupted = True
        self._stop_running_ranks(reason="interrupt")

    def _stop_running_ranks(self, reason: str) -> None:
        """SIGINT (cooperative under mpnb.should_stop), then a hard SIGINT, then release and give up."""
        running = self._running_ranks()
        if not running:
            return
        if reason == "timeout":  # where were they? (the stop below may change it)
            self.stacks.update(watchdog.dump_stacks(self.session, running, self.execution_count))
            stuck = [r for r in running if watchdog.in_collective(self.stacks.get(r, ""))]
            if stuck and len(running) < len(self.ranks):  # waiting for ranks that already left
                self._release("the timeout", stacks_known=True)
                self._wait_running(HARD_STOP_GRACE_S)
                running = self._running_ranks()
        self._signal(running, signal.SIGINT)
        if not self._wait_running(INTERRUPT_GRACE_S):  # a second interrupt: hard stop now
            self.notes.append("A second interrupt forced a hard stop.")
        running = self._running_ranks()
        if running:
            self._signal(running, signal.SIGINT)  # the second SIGINT raises KeyboardInterrupt on the rank
            self._wait_running(HARD_STOP_GRACE_S)
        running = self._running_ranks()
        if running and len(running) < len(self.ranks):
            self.stacks.update(watchdog.dump_stacks(self.session, running, self.execution_count))
            self._release(f"the {reason}", stacks_known=True)
            self._wait_running(HARD_STOP_GRACE_S)
        self._release_at = None
        self._give_up_on_running("did not stop")
        self._publish_state()

    def _wait_running(self, seconds: float) -> bool:
        """Process events for up to `seconds` while ranks run; False if interrupted again."""
        deadline = time.monotonic() + seconds
        while self._running() and time.monotonic() < deadline:
            try:
                self._drain_events(TICK_S)
            except KeyboardInterrupt:
                return False
            self.renderer.flush(time.monotonic())
            if time.monotonic() >= self._next_death_check:
                self._next_death_check = time.monotonic() + DEATH_CHECK_S
                self._check_deaths(time.monotonic())
        return True

    # -- conclusion
    def _conclude(self) -> DistributedResult | None:
        self._publish_state(final=True)
        advice = recovery.advice(self.session) if recovery.needs(self.session) else ""
        if self.timed_out:
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
            failures = self._group_errors(real_errors)
            if self.first_failure is not None:  # the cause first, the ranks it took down after
                first = self.first_failure[0]
                failures.sort(key=lambda f: first not in f.ranks)
            raise CellFailedError(failures, self.ranks, note=note)
        if not self.results or self.options.quiet:
            return None
        wanted = (
            self.results
            if self.options.output != "rank0"
            else {r: v for r, v in self.results.items() if r == self.ranks[0]}
        )
        return DistributedResult(wanted) if wanted else None

    def _story(self) -> list[str]:
        """What happened, for the message: first failure, releases, deaths, and where ranks were stuck."""
        lines = []
        if self.first_failure is not None and len(self.ranks) > 1:
            r = self.first_failure[0]
            e = self.errors.get(r, {})
            lines.append(f"{format_ranks([r])} failed first: {e.get('ename', 'Error')}: {e.get('evalue')}")
        lines.extend(self.notes)
        if self.stacks:
            lines.append("Where the ranks were (Python stacks, most recent call last):")
            lines.append(_stack_text(self.stacks))
        return lines

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


def _stack_text(stacks: dict[int, str]) -> str:
    return "\n".join(f"  [{format_ranks([r])}]\n{stacks[r]}" for r in sorted(stacks) if stacks[r])


def _innermost(stack: str) -> str:
    """The cell line and the innermost frame of a formatted stack, for a one-line note."""
    lines = [ln.strip() for ln in stack.splitlines() if ln.strip() and not ln.strip().startswith("...")]
    cell = [line for line in lines if line.startswith("Cell In[")]
    return f"{cell[-1]} -> {lines[-1]}" if cell and cell[-1] != lines[-1] else (lines[-1] if lines else "?")


_ENGINE_CELL = re.compile(r"(Cell(?:\x1b\[[0-9;]*m|\s)+In\[)\d+\]")  # colours sit between the words


def _is_engine_death(reply: Any) -> bool:
    """ipyparallel answers a dead engine's request with an EngineError (as an exception or a reply)."""
    if type(reply).__name__ == "EngineError" or getattr(reply, "ename", None) == "EngineError":
        return True
    content = reply.get("content", {}) if isinstance(reply, dict) else {}
    return isinstance(content, dict) and content.get("ename") == "EngineError"


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
    recovery.check_ready(session)  # after a crash or release: say whether to heal or restart, before sending
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
        from mpnb.monitoring.chart import cell_chart
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
