"""Cluster lifecycle through `%mpnb` in a real IPython shell: bad input, start, status, config, restart, stop.

This module manages its own clusters (it tests starting and stopping them), so it does
not use the shared `cluster` fixture.
"""

from __future__ import annotations

import os
import re
import time

import psutil
import pytest

import mpnb
from mpnb.cluster.session import current
from mpnb.engine.bootstrap import nanny_pids
from mpnb.errors import ClusterError, ConfigError, NoClusterError
from tests.helpers import both, children, expect_error, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_session")]


def wait_for_children(expected: set[int], timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = children()
        if now <= expected:
            return now
        time.sleep(0.2)
    return children()


def assert_torch_preloaded(sess: mpnb.Session) -> None:
    """The engines run mpnb's boot module, which imported torch while they registered."""
    from mpnb.engine import boot

    for info, took in zip(sess.ranks, sess.view().apply_sync(boot.wait_for_torch), strict=True):
        assert "mpnb.engine.boot" in psutil.Process(info.pid).cmdline()
        assert took is not None and took > 0, f"rank {info.rank} did not preload torch"


def test_a_start_that_fails_on_the_engines_leaves_nothing_running(ipython, fake_gpus):
    # The kernel believes in GPU 0 (faked) but torch on the engines has no CUDA, so binding fails
    # after the controller and engines are up: the start must roll all of it back.
    before = children()
    out = expect_error(ipython, "%mpnb start --devices 0 --backend gloo", ClusterError, "rolled back", "CUDA")
    assert "Setting up torch.distributed failed" in out
    assert wait_for_children(before) <= before
    assert current() is None


def test_lifecycle_start_status_config_push_pull_restart_stop(ipython):
    ip = ipython
    before = children()
    changes: list[str] = []
    from mpnb.cluster.session import on_change

    unsubscribe = on_change(lambda s: changes.append(s.last_event))
    try:
        res, out = run(ip, "%mpnb start -n 2 --timeout 30")
        assert res.success, out
        assert re.fullmatch(
            r"mpnb: 2 ranks ready in \d+\.\d s · devices: cpu x2 · backend gloo · process group timeout 30 s",
            out.strip(),
        )
        sess = mpnb.session()
        assert [r.rank for r in sess.ranks] == [0, 1] and sess.world_size == 2 and sess.backend == "gloo"
        assert len(children() - before) >= 3  # controller + 2 engines

        assert_torch_preloaded(sess)
        expect_error(ip, "%mpnb start", ClusterError, "already running", "%mpnb stop")

        _, out = run(ip, "%mpnb status")
        rows = out.strip().splitlines()
        assert rows[1].split() == ["rank", "host", "pid", "device", "alive", "busy"]
        pids = {r.pid for r in sess.ranks}
        for rank, row in enumerate(rows[2:]):
            cells = row.split()
            assert cells[0] == str(rank) and int(cells[2]) in pids and cells[3:] == ["cpu", "True", "False"]

        # right after a blocking call the controller may still count it as queued: not busy
        for _ in range(5):  # before the fix: 16 in 200 status calls here showed a rank busy
            sess.view().apply_sync(os.getpid)
            busy = [row["busy"] for row in sess.rank_status(fresh=True)]
            assert busy == [False, False], sess.client.queue_status(verbose=True)

        # a rank running something shows as busy (the controller answers; the engines are not asked)
        sleeping = sess.view().execute("import time; time.sleep(4)")
        time.sleep(1)  # let the controller see the request before asking it
        _, out = run(ip, "%mpnb status")
        assert [row.split()[-1] for row in out.strip().splitlines()[2:]] == ["True", "True"]
        sleeping.get()

        # config: set, shown, pushed to every rank; impossible values refused
        res, out = run(ip, "%mpnb config micro_batch_size=4 strategy=zero zero_stage=2")
        assert res.success, out
        assert sess.config.micro_batch_size == 4 and sess.config.zero_stage == 2
        _, out = run(
            ip,
            "%%distributed\ncfg = mpnb.engine.state.config\n"
            "print(cfg['micro_batch_size'], cfg['zero_stage'])",
        )
        assert out.strip() == "[ranks 0,1] 4 2"
        expect_error(ip, "%mpnb config micro_batch_size=-1", ConfigError)
        assert sess.config.micro_batch_size == 4

        # push and pull
        ip.user_ns["lr"] = 0.25
        assert run(ip, "%mpnb push lr")[0].success
        assert run(ip, "%%distributed\nscaled = lr * (rank + 1)")[0].success
        assert ip.run_line_magic("mpnb", "pull scaled") == {0: 0.25, 1: 0.5}
        assert ip.run_line_magic("mpnb", "pull scaled --rank 1") == 0.5
        expect_error(ip, "%mpnb pull nothing_here", ConfigError, "Could not pull 'nothing_here'")
        expect_error(ip, "%mpnb push not_defined_anywhere", ConfigError, "not defined in the notebook")
        expect_error(ip, "%mpnb pull scaled --rank 7", ClusterError, "There is no rank 7")

        # restart: new engines (new ids, new pids), same world size, fresh namespaces, working group
        old_ids = {r.engine_id for r in sess.ranks}
        res, out = run(ip, "%mpnb restart")
        assert res.success, out
        assert "mpnb: 2 ranks ready" in out
        assert mpnb.session() is sess and sess.world_size == 2
        assert not old_ids & {r.engine_id for r in sess.ranks}
        assert not pids & {r.pid for r in sess.ranks}
        assert_torch_preloaded(sess)  # the restarted engines come from the same launcher
        res, out = run(
            ip, "%%distributed\nprint('scaled' in dir())\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        )
        assert res.success and both(out, "False") and out.strip().endswith("2.0")
        _, out = run(ip, "%%distributed\nprint(mpnb.engine.state.config['micro_batch_size'])")
        assert out.strip() == "[ranks 0,1] 4"  # the session's config survives a restart

        nannies = [pid for pids in sess.view().apply_sync(nanny_pids) for pid in pids]
        assert len(nannies) == 2, nannies  # one per engine (they relay signals)
        assert sorted(n for r in sess.ranks for n in r.nannies) == sorted(nannies)
        res, out = run(ip, "%mpnb stop")
        assert res.success and "cluster stopped" in out
        assert sess.closed and current() is None
        assert wait_for_children(before) <= before
        # ipyparallel's nannies can hang after their engine is gone; none may outlive the stop
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in nannies if psutil.pid_exists(pid)], 15)
        assert not alive, f"nanny processes left running: {[p.pid for p in alive]}"
    finally:
        unsubscribe()
    assert changes[0] == "start" and "config" in changes and "restart" in changes and changes[-1] == "stop"
    assert "cell" in changes


def test_python_api_start_and_stop():
    sess = mpnb.start(n=2, timeout=20, verbose=False)
    try:
        assert mpnb.session() is sess
        sess.view().execute(
            "import os; from mpnb.engine import state as s; ws, r = os.environ['WORLD_SIZE'], s.rank"
        ).get()
        assert sess.view().pull("ws", block=True) == ["2", "2"]
        assert sess.view([1, 0]).pull("r", block=True) == [1, 0]  # views list ranks in the order asked
    finally:
        mpnb.stop()
    with pytest.raises(NoClusterError):
        mpnb.session()
