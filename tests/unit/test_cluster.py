"""`%mpnb` input refused before anything starts (real IPython shell): bad options, devices vs visible GPUs."""

from __future__ import annotations

import socket

import pytest

import mpnb
from mpnb.cluster.session import current
from mpnb.errors import ClusterError, ConfigError, NoClusterError
from tests.helpers import children, expect_error, run

pytestmark = pytest.mark.usefixtures("no_leftover_session")


def test_bad_input_is_refused_before_anything_starts(ipython):
    before = children()
    expect_error(ipython, "%%distributed\nprint(1)", NoClusterError, "%mpnb start")
    expect_error(ipython, "%mpnb start -n 0", ConfigError, "-n must be", "at least 1")
    expect_error(ipython, "%mpnb start -n two", ConfigError, "invalid int value")
    expect_error(
        ipython, "%mpnb start --frobnicate", ConfigError, "unrecognized arguments: --frobnicate", "Usage"
    )
    expect_error(ipython, "%mpnb launch", ConfigError, "Unknown subcommand `%mpnb launch`", "%mpnb start")
    expect_error(ipython, "%mpnb", ConfigError, "needs a subcommand")
    expect_error(ipython, "%mpnb start --devices 0,1", ConfigError, "not visible", "Leave --devices out")
    expect_error(
        ipython, "%mpnb start --backend nccl", ConfigError, "nccl backend needs GPUs", "--backend gloo"
    )
    expect_error(ipython, "%mpnb start --backend mpi", ConfigError, "invalid choice: 'mpi'")
    expect_error(ipython, "%mpnb start --timeout -5", ConfigError, "positive number of seconds")
    expect_error(ipython, "%mpnb start --timeout 0", ConfigError, "positive number of seconds")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        expect_error(ipython, f"%mpnb start --port {port}", ClusterError, f"Port {port} is already in use")
    expect_error(ipython, "%mpnb restart", NoClusterError, "%mpnb start")
    expect_error(ipython, "%mpnb pull x", NoClusterError)
    _, out = run(ipython, "%mpnb status")
    assert "No mpnb cluster is running" in out
    with pytest.raises(NoClusterError):
        mpnb.session()
    assert current() is None
    assert children() <= before  # nothing was started by any of it


def test_device_choices_are_checked_against_visible_gpus(ipython, fake_gpus):
    expect_error(
        ipython, "%mpnb start --devices 0,5", ConfigError, "GPU 5 is not visible", "Visible GPUs: 0, 1"
    )
    expect_error(ipython, "%mpnb start --devices 0,0", ConfigError, "lists a GPU twice")
    expect_error(ipython, "%mpnb start --devices 0,x", ConfigError, "GPU indices separated by commas")
    expect_error(ipython, "%mpnb start -n 3", ConfigError, "more engines than there are visible GPUs (2)")
    expect_error(ipython, "%mpnb start -n 1 --devices 0,1", ConfigError, "does not match")
