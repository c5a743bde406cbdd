"""A rank whose peer died reports one line naming the death, not its transport's traceback."""

from __future__ import annotations

from mpnb.execution.report import RankFailure, collapse_lost_peers

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
