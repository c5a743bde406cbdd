"""When `RankMerger` shows a line alone and when it waits for the other ranks to print it too."""

from __future__ import annotations

from mpnb.execution.output import MAX_START_LAG_S, RankMerger


def shown(merger: RankMerger, now: float) -> list[tuple[list[int], str]]:
    return [(ranks, item.payload) for ranks, item in merger.drain(now)]


def test_ranks_that_began_together_are_waited_for_only_the_hold():
    merger = RankMerger([0, 1], hold_s=0.3)
    merger.began(0, 0.0)
    merger.began(1, 0.0)
    merger.add_text(0, "stdout", "loss 1.0\n", 1.0)
    assert shown(merger, 1.2) == []  # rank 1 may still print it
    assert shown(merger, 1.31) == [([0], "loss 1.0")]  # it did not: rank 0's line goes out alone


def test_a_rank_that_began_late_is_waited_for_as_much_longer():
    merger = RankMerger([0, 1], hold_s=0.3)
    merger.began(0, 0.0)
    merger.began(1, 0.8)  # its engine was busy: it began the cell 0.8 s after rank 0
    merger.add_text(0, "stdout", "loss 1.0\n", 1.0)
    assert shown(merger, 1.5) == []  # a fixed 0.3 s hold would have shown rank 0's line alone here
    merger.add_text(1, "stdout", "loss 1.0\n", 1.8)  # 1.0 s into its own run, as rank 0's was
    assert shown(merger, 1.8) == [([0, 1], "loss 1.0")]


def test_a_rank_that_has_not_begun_is_waited_for_at_most_the_cap():
    merger = RankMerger([0, 1], hold_s=0.3)
    merger.began(0, 0.0)
    merger.add_text(0, "stdout", "step 1\n", 0.5)
    assert shown(merger, 0.5 + MAX_START_LAG_S) == []
    assert shown(merger, 0.5 + 0.3 + MAX_START_LAG_S) == [([0], "step 1")]


def test_a_rank_that_prints_alone_is_not_held_back_by_a_rank_that_began_first():
    merger = RankMerger([0, 1], hold_s=0.3)
    merger.began(1, 0.0)
    merger.began(0, 0.5)
    merger.add_text(0, "stdout", "only rank 0 prints this\n", 1.0)
    assert shown(merger, 1.31) == [([0], "only rank 0 prints this")]


def test_without_start_times_the_hold_counts_from_the_line_alone():
    merger = RankMerger([0, 1], hold_s=0.3)
    merger.add_text(1, "stdout", "x\n", 2.0)
    assert shown(merger, 2.2) == []
    assert shown(merger, 2.31) == [([1], "x")]
