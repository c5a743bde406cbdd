"""Watching the ranks of a running cell: deaths, hangs, releasing blocked peers, stopping.

A rank blocked in a gloo collective cannot be interrupted, and it waits for
peers that will never come when another rank failed, died, or skipped the
collective. Every tick (`Supervisor.tick`) the supervisor checks for dead ranks
(`mpnb.cluster.watchdog`), for a rank that failed while others still run
(after FAIL_GRACE_S it dumps the others' stacks and ends the process group on
the finished ranks, which releases peers blocked in a collective at once), for
a hang (some ranks finished, others stuck in a collective) and for the cell's
--timeout. The stop button and --timeout escalate: SIGINT (cooperative under
`mpnb.should_stop()`), a second SIGINT, a release, then the ranks still busy
are given up on as `stopped`. See docs/internals.md, "Recovery model".
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from mpnb.cluster import recovery, watchdog
from mpnb.execution.output import format_ranks
from mpnb.execution.report import broke_peers, innermost, stack_text
from mpnb.execution.states import DONE, FAILED, RUNNING, STOPPED

if TYPE_CHECKING:
    from mpnb.cluster.session import Session

log = logging.getLogger("mpnb")

TICK_S = 0.05  # how often output is flushed and timeouts checked while ranks run
INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long ranks get to return before a hard stop
HARD_STOP_GRACE_S = 3.0  # after the hard stop, how long before ranks still busy are marked stopped
FAIL_GRACE_S = 0.5  # a rank failed: how long the others may still finish on their own before release
RELEASE_GRACE_S = 7.0  # after a release, how long before ranks still running are given up on
LATE_SIGINT_S = 2.0  # after a release, when ranks of unknown whereabouts still running get SIGINT
DEATH_CHECK_S = 0.25  # how often running ranks' processes are checked


class SupervisedRun(Protocol):
    """What the supervisor reads from and does to the cell run it watches (`CellRun`)."""

    session: Session
    ranks: list[int]
    status: dict[int, str]
    errors: dict[int, dict]
    execution_count: int | None
    started: float

    def running_ranks(self) -> list[int]: ...
    def is_running(self) -> bool: ...
    def finish_rank(self, rank: int, state: str) -> None: ...
    def mark_dead(self, rank: int, description: str, now: float) -> None: ...
    def drain_events(self, timeout: float) -> None: ...
    def flush_output(self, now: float) -> None: ...
    def publish_state(self) -> None: ...


class Supervisor:
    """What went wrong in one cell run, in order, and what was done about it."""

    def __init__(self, run: SupervisedRun, timeout: float | None) -> None:
        self.run = run
        self.session = run.session
        self.timeout = timeout  # the cell's --timeout in seconds, or None
        self.timed_out = False
        self.interrupted = False
        self.notes: list[str] = []  # what the notebook is told, in order
        self.stacks: dict[int, str] = {}  # rank -> where it was stuck (faulthandler)
        self.deaths: list[watchdog.Death] = []
        self.first_failure: tuple[int, float] | None = None  # (rank, when)
        self.released = False  # the process group was destroyed to free waiting ranks
        self._release_at: float | None = None
        self._late_sigint: list[int] = []  # released ranks whose stack was unknown: SIGINT if still running
        self._next_death_check = 0.0
        self._partial_since: float | None = None  # some ranks finished while others still run
        self._hang_checked = False

    # -- what the run reports
    def rank_finished(self, rank: int, state: str, now: float) -> None:
        first = self.first_failure
        if state == FAILED and first is None and self.run.is_running():
            self.first_failure = (rank, now)
        elif state == FAILED and first and broke_peers(self.run.errors, rank, first[0]):
            self.first_failure = (rank, first[1])  # its peers' lost-peer errors came in sooner
        if state == DONE and self._partial_since is None and self.run.is_running():
            self._partial_since = now
        if self.released and self.run.is_running():  # its peers may wait on it (a ring): release them
            self._end_group_on([rank])

    def tick(self, now: float) -> None:
        """Every TICK_S while ranks run: deaths, a failure to release, a hang, late signals, --timeout."""
        run = self.run
        if now >= self._next_death_check and run.is_running():
            self._next_death_check = now + DEATH_CHECK_S
            self.check_deaths(now)
        failure = self.first_failure
        if failure and not self.released and run.is_running() and now - failure[1] >= FAIL_GRACE_S:
            self._release(f"{format_ranks([failure[0]])} failed")
        since = self._partial_since
        hang_due = since is not None and now - since >= self._hang_after()
        if hang_due and not self._hang_checked and run.is_running():
            self._check_hang(now)
        if self._late_sigint and self._release_at is not None and now - self._release_at > LATE_SIGINT_S:
            self._signal([r for r in self._late_sigint if run.status[r] == RUNNING], signal.SIGINT)
            self._late_sigint = []
        if self._release_at is not None and now - self._release_at > RELEASE_GRACE_S:
            self._release_at = None
            self._give_up_on_running("did not return after the others were released")
        if self.timeout is not None and now - run.started > self.timeout and not self.timed_out:
            self.timed_out = True
            self._stop_running_ranks(reason="timeout")

    def interrupt(self) -> None:
        """The notebook's stop button: interrupt running ranks, give them a moment, mark the rest stopped."""
        self.interrupted = True
        self._stop_running_ranks(reason="interrupt")

    def _hang_after(self) -> float:
        """Seconds a rank may run on alone before the watchdog looks at its stack."""
        return min(10.0, max(2.0, self.session.timeout / 3))

    # -- deaths and hangs
    def check_deaths(self, now: float, certain: Sequence[int] = ()) -> None:
        """Ranks whose engine is gone fail with rank, host and signal; survivors are released."""
        run = self.run
        deaths = watchdog.dead_ranks(self.session, run.running_ranks())
        for r in certain:  # the controller already said so: the cause may not be readable yet
            if r not in [d.rank for d in deaths] and run.status[r] == RUNNING:
                info = self.session.ranks[r]
                cause = watchdog.exit_cause(info.pid, self.session) if watchdog.is_local(info) else None
                deaths.append(watchdog.Death(r, info.host, info.pid, cause or "died (its engine is gone)"))
        if not deaths:
            return
        for d in deaths:
            self.deaths.append(d)
            run.mark_dead(d.rank, d.describe(), now)
        if self.first_failure is None or self.first_failure[0] not in [d.rank for d in deaths]:
            self.first_failure = (deaths[0].rank, now)
        recovery.mark(self.session, "restart", "; ".join(d.describe() for d in deaths))
        oom = any("SIGKILL" in d.cause for d in deaths)
        self.notes.append(
            "Lost "
            + "; ".join(d.describe() for d in deaths)
            + (" (out of memory? the OOM killer sends SIGKILL)." if oom else ".")
        )
        if run.is_running():
            self._release(f"{format_ranks([d.rank for d in deaths])} died")

    def _check_hang(self, now: float) -> None:
        """Some ranks finished long ago; if the others wait in a collective, nobody will ever join them."""
        self._hang_checked = True
        running = self.run.running_ranks()
        stacks = watchdog.dump_stacks(self.session, running, self.run.execution_count)
        self.stacks.update(stacks)
        waiting = [r for r in running if watchdog.in_collective(stacks.get(r, ""))]
        finished = [r for r, s in self.run.status.items() if s != RUNNING]
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
                f"{format_ranks(finished)} finished; now at:\n" + stack_text(stacks),
                file=sys.stderr,
                flush=True,
            )

    # -- releasing blocked peers
    def _release(self, cause: str, stacks_known: bool = False) -> None:
        """Free ranks still running after a failure: stacks, then end the group, then SIGINT the rest."""
        running = self.run.running_ranks()
        if not running:
            return
        log.debug("release after %s at %.2f s", cause, time.monotonic() - self.run.started)
        if not stacks_known:
            self.stacks.update(watchdog.dump_stacks(self.session, running, self.run.execution_count))
        dead = {d.rank for d in self.deaths}
        alive_ids = set(self.session.client.ids)
        finished = [
            r
            for r, s in self.run.status.items()
            if s != RUNNING and r not in dead and self.session.engine_id(r) in alive_ids
        ]
        self._end_group_on(finished)
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
        where = "; ".join(
            f"{format_ranks([r])} was in {innermost(self.stacks[r])}" for r in waiting if self.stacks.get(r)
        )  # a rank whose dump could not be read (or trusted) is left out
        self.notes.append(
            f"After {cause}, mpnb released {format_ranks(running)}"
            + (f" ({where})" if where else "")
            + " by ending the process group on the ranks that had finished."
        )
        self._release_at = time.monotonic()

    def _end_group_on(self, finished: list[int]) -> None:
        """`control.release_peers` on the idle ranks, without waiting for it."""
        if not finished:
            return
        from mpnb.engine import control  # only its functions travel; the module imports no torch at load

        try:
            # dead ranks are left out; the rest carry their start time, so a reused pid is skipped
            dead = {d.rank for d in self.deaths}
            peers: dict[str, list[tuple[int, int | None]]] = {}
            for info in self.session.ranks:
                if info.rank not in dead:
                    peers.setdefault(info.host, []).append((info.pid, info.started))
            ar = self.session.view(finished).apply_async(control.release_peers, peers)
            ar.add_done_callback(lambda f: log.debug("group ended on %s: %s", finished, f.exception()))
        except Exception:
            log.exception("mpnb: could not release the process group on %s", finished)

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
        running = self.run.running_ranks()
        if not running:
            return
        stacks = watchdog.dump_stacks(self.session, running, self.run.execution_count)
        self.stacks.update(stacks)
        for r in running:
            self.run.finish_rank(r, STOPPED)
        recovery.mark(
            self.session,
            "restart" if self.deaths else "heal" if self.released else "wait",
            f"{format_ranks(running)} {why} and may still be busy (blocked in C code)",
            busy=running,
        )
        self.notes.append(
            f"{format_ranks(running)} {why}; still busy at:\n{stack_text(stacks)}\n"
            f"It returns at the process-group timeout ({self.session.timeout:g} s)."
        )

    # -- stopping
    def _stop_running_ranks(self, reason: str) -> None:
        """SIGINT (cooperative under mpnb.should_stop), then a hard SIGINT, then release and give up."""
        running = self.run.running_ranks()
        if not running:
            return
        if reason == "timeout":  # where were they? (the stop below may change it)
            self.stacks.update(watchdog.dump_stacks(self.session, running, self.run.execution_count))
            stuck = [r for r in running if watchdog.in_collective(self.stacks.get(r, ""))]
            if stuck and len(running) < len(self.run.ranks):  # waiting for ranks that already left
                self._release("the timeout", stacks_known=True)
                self._wait_running(HARD_STOP_GRACE_S)
                running = self.run.running_ranks()
        self._signal(running, signal.SIGINT)
        if not self._wait_running(INTERRUPT_GRACE_S):  # a second interrupt: hard stop now
            self.notes.append("A second interrupt forced a hard stop.")
        running = self.run.running_ranks()
        if running:
            self._signal(running, signal.SIGINT)  # the second SIGINT raises KeyboardInterrupt on the rank
            self._wait_running(HARD_STOP_GRACE_S)
        running = self.run.running_ranks()
        if running and len(running) < len(self.run.ranks):
            self.stacks.update(watchdog.dump_stacks(self.session, running, self.run.execution_count))
            self._release(f"the {reason}", stacks_known=True)
            self._wait_running(HARD_STOP_GRACE_S)
        self._release_at = None
        self._give_up_on_running("did not stop")
        self.run.publish_state()

    def _wait_running(self, seconds: float) -> bool:
        """Process events for up to `seconds` while ranks run; False if interrupted again."""
        run = self.run
        deadline = time.monotonic() + seconds
        while run.is_running() and time.monotonic() < deadline:
            try:
                run.drain_events(TICK_S)
            except KeyboardInterrupt:
                return False
            run.flush_output(time.monotonic())
            if time.monotonic() >= self._next_death_check:
                self._next_death_check = time.monotonic() + DEATH_CHECK_S
                self.check_deaths(time.monotonic())
        return True
