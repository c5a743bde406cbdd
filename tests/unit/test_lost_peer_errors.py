"""A rank whose peer died reports one line naming the death, not its transport's traceback."""

from __future__ import annotations

from mpnb.execution.report import RankFailure, collapse_lost_peers
from mpnb.execution.states import FAILED, RUNNING
from mpnb.execution.supervisor import Supervisor

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:2991: Connection reset by peer. This is typically caused by a remote worker hanging")


def test_a_survivors_gloo_error_becomes_one_line_naming_the_dead_rank():
    died = RankFailure([1], "RankDied", "rank 1 (pid 7 on vm) killed by SIGKILL (exit code -9)", [])
    survivor = RankFailure([0], "RuntimeError", GLOO, ["Traceback (most recent call last):", "  ...", "x"])
    shown = collapse_lost_peers([died, survivor])
    assert shown[0] is died
    assert shown[1].ranks == [0] and shown[1].traceback == []
    assert shown[1].evalue == "its collective broke off when rank 1 died (Connection reset by peer)"


def test_without_a_death_or_for_other_errors_nothing_changes():
    alone = RankFailure([0], "RuntimeError", GLOO, ["tb"])
    assert collapse_lost_peers([alone]) == [alone]  # no rank died: the gloo error is the news
    died = RankFailure([1], "RankDied", "rank 1 exited", [])
    own = RankFailure([0], "ValueError", "bad shape", ["tb"])
    assert collapse_lost_peers([died, own]) == [died, own]


class TwoRanks:
    """The part of a cell run the supervisor reads when a rank finishes (`SupervisedRun`)."""

    def __init__(self) -> None:
        self.session = None
        self.ranks = [0, 1]
        self.status = {0: RUNNING, 1: RUNNING}
        self.errors: dict[int, dict] = {}
        self.started = 0.0

    def is_running(self) -> bool:
        return RUNNING in self.status.values()

    def fail(self, supervisor: Supervisor, rank: int, ename: str, evalue: str, now: float) -> None:
        self.errors[rank] = {"ename": ename, "evalue": evalue, "traceback": []}
        self.status[rank] = FAILED
        supervisor.rank_finished(rank, FAILED, now)


def test_the_rank_whose_failure_closed_the_connections_is_named_first_even_when_it_reports_last():
    run = TwoRanks()
    supervisor = Supervisor(run, timeout=None)
    run.fail(supervisor, 0, "RuntimeError", GLOO, now=1.0)  # the peer's read error came in first
    run.fail(supervisor, 1, "ValueError", "rank 1 gives up", now=1.2)
    assert supervisor.first_failure == (1, 1.0)  # the cause, at the time the failure was first seen


def test_a_first_failure_of_its_own_is_kept():
    run = TwoRanks()
    supervisor = Supervisor(run, timeout=None)
    run.fail(supervisor, 0, "ValueError", "bad shape", now=1.0)
    run.fail(supervisor, 1, "ValueError", "rank 1 gives up", now=1.2)
    assert supervisor.first_failure == (0, 1.0)
    run = TwoRanks()
    supervisor = Supervisor(run, timeout=None)
    run.fail(supervisor, 0, "RuntimeError", GLOO, now=1.0)
    run.fail(supervisor, 1, "RuntimeError", GLOO, now=1.2)  # both lost a peer: nothing better to name
    assert supervisor.first_failure == (0, 1.0)
