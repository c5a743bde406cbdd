"""`%%distributed` and `%mpnb` numeric options refused before any engine work (real IPython shell).

`--ranks` is checked as spans against the world before any list is built (a huge range costs
nothing); `--timeout` goes through one parser everywhere (`launch.check_timeout`).
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from mpnb.errors import ConfigError, NoClusterError
from mpnb.execution.options import CellOptions, parse_ranks, ranks_from_args
from tests.helpers import children, expect_error

pytestmark = pytest.mark.usefixtures("no_leftover_session")


def test_a_huge_range_is_refused_at_once_without_building_it():
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        for text in ("0-999999999", "1,0-999999999", "0-" + "9" * 400):
            with pytest.raises(ConfigError, match="do not exist: this cluster has ranks 0-1"):
                parse_ranks(text, 2)
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 0.5, took  # building the list would take many seconds
    assert peak < 100_000, peak  # a list of a billion ranks would be gigabytes
    with pytest.raises(ConfigError, match=r"Ranks 2-999999999 do not exist"):
        ranks_from_args("0-999999999", None, 2)


def test_rank_lists_and_their_mistakes():
    assert parse_ranks("0-3", 4) == [0, 1, 2, 3]
    assert parse_ranks("2, 0", 4) == [2, 0]  # the order given
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    assert ranks_from_args(None, None, 4) is None
    assert ranks_from_args(None, 3, 4) == [3]
    cases = [
        ("3-1", "--ranks 3-1: a range goes low-high, e.g. 1-3"),
        ("0,5", "Rank 5 does not exist: this cluster has ranks 0-3"),
        ("0-2,2-3", "--ranks lists rank 2 twice"),
        ("1,1", "--ranks lists rank 1 twice"),
        ("x", "--ranks takes rank numbers"),
        ("-1", "--ranks takes rank numbers"),
        (",", "--ranks is empty"),
    ]
    for text, message in cases:
        with pytest.raises(ConfigError) as info:
            parse_ranks(text, 4)
        assert message in str(info.value), (text, str(info.value))
    with pytest.raises(ConfigError, match="Rank 1 does not exist: this cluster has only rank 0"):
        ranks_from_args(None, 1, 1)
    with pytest.raises(ConfigError, match="Rank -1 does not exist"):
        ranks_from_args(None, -1, 4)
    with pytest.raises(ConfigError, match="either --ranks or --rank"):
        ranks_from_args("0", 1, 4)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "1e999", "abc", ""])
def test_bad_cell_timeouts_are_refused_before_a_cluster_is_needed(ipython, value):
    # no cluster runs: a check that waited for one would say "No mpnb cluster is running" instead
    expect_error(
        ipython,
        f"%%distributed --timeout={value}\nprint('must not run')",
        ConfigError,
        f"--timeout must be a positive number of seconds, not '{value}'",
        "Example: `%%distributed --timeout 600`",
    )
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="--timeout must be a positive number"):
            CellOptions(timeout=bad).check()


def test_other_cell_option_mistakes_come_before_the_cluster(ipython):
    expect_error(ipython, "%%distributed --ranks 3-1\npass", ConfigError, "a range goes low-high, e.g. 1-3")
    expect_error(ipython, "%%distributed --ranks 0,x\npass", ConfigError, "--ranks takes rank numbers")
    expect_error(ipython, "%%distributed --output fancy\npass", ConfigError, "--output must be one of")
    # well-formed options: now the missing cluster is the problem, found before any list is built
    tracemalloc.start()
    try:
        huge = "%%distributed --ranks 0-999999999 --timeout 5\npass"
        expect_error(ipython, huge, NoClusterError, "%mpnb start")
        assert tracemalloc.get_traced_memory()[1] < 50 * 2**20  # a billion ranks: tens of GiB
    finally:
        tracemalloc.stop()
    opts = CellOptions(timeout="2.5")
    opts.check()
    assert opts.timeout == 2.5


@pytest.mark.parametrize("command", ["start", "connect --profile nowhere"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "0", "-3", "soon"])
def test_cluster_timeouts_share_the_one_parser(ipython, command, value):
    before = children()
    expect_error(
        ipython,
        f"%mpnb {command} --timeout={value}",
        ConfigError,
        f"--timeout must be a positive number of seconds, not '{value}'",
        "Example: `%mpnb start --timeout 60` (the default is 60)",
    )
    assert children() <= before  # refused before anything started


def test_an_engine_count_past_what_the_machine_takes_is_refused(ipython):
    before = children()
    expect_error(ipython, "%mpnb start -n 1000000", ConfigError, "-n 1000000 would start 1,000,000 engine")
    assert children() <= before
