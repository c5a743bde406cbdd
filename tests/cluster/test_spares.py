"""The warm spare engine set (`mpnb.cluster.spares`): `%mpnb restart` forms its world on it.

Own clusters (it tests starting, restarting and stopping them), so not the shared `cluster` fixture.
"""

from __future__ import annotations

import psutil
import pytest

import mpnb
from mpnb.cluster import spares
from tests.helpers import children, run, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_leftover_session")]


def engine_modules(sess: mpnb.Session, ids: list[int]) -> list[tuple[int, bool, bool]]:
    """(pid, torch imported, DeepSpeed imported) of each engine."""

    def probe() -> tuple[int, bool, bool]:
        import os
        import sys

        return os.getpid(), "torch" in sys.modules, "deepspeed" in sys.modules

    return sess.client[ids].apply_sync(probe)


def test_restart_takes_the_warm_spares_and_keeps_a_new_set(ipython):
    ip = ipython
    before = children()
    res, out = run(ip, "%mpnb start -n 2")
    assert res.success, out
    sess = mpnb.session()
    busy = spares.IDLE_BEFORE_LAUNCH_S + 2
    res, out = run(ip, f"%%distributed --no-monitor\nimport time\ntime.sleep({busy})")
    assert res.success, out
    assert sess.spares is None and len(sess.client.ids) == 2  # none launched while a cell ran
    assert wait_for(lambda: spares.ready(sess), timeout=120), "the spares never became ready"
    spare_ids = spares.engine_ids(sess)
    probed = engine_modules(sess, spare_ids)
    assert len(probed) == 2 and all(torch and ds for _, torch, ds in probed)  # warm: imported already
    assert not set(spare_ids) & {r.engine_id for r in sess.ranks}
    old_pids = [r.pid for r in sess.ranks]

    res, out = run(ip, "%mpnb restart")
    assert res.success, out
    assert "mpnb: 2 ranks ready" in out
    assert sorted(r.engine_id for r in sess.ranks) == spare_ids  # the spares became the ranks
    assert {r.pid for r in sess.ranks} == {pid for pid, _, _ in probed}
    _, alive = psutil.wait_procs([psutil.Process(p) for p in old_pids if psutil.pid_exists(p)], 15)
    assert not alive, "the old ranks' engines outlived the restart"
    cell = "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(rank, world_size, t.item())"
    res, out = run(ip, cell)
    assert res.success and "[rank 0] 0 2 2.0" in out and "[rank 1] 1 2 2.0" in out, out

    # a new spare set for the next restart, once the session idles
    assert wait_for(lambda: len(spares.engine_ids(sess)) == 2, timeout=60)
    res, out = run(ip, "%mpnb stop")
    assert res.success
    assert wait_for(lambda: children() <= before, timeout=20), f"left after stop: {children() - before}"


def test_no_spares_starts_only_the_ranks_and_restart_starts_fresh_engines(ipython):
    ip = ipython
    res, out = run(ip, "%mpnb start -n 2 --no-spares")
    assert res.success, out
    sess = mpnb.session()
    assert sess.spares is None and len(sess.client.ids) == 2
    old = {r.pid for r in sess.ranks}
    res, out = run(ip, "%mpnb restart")
    assert res.success, out
    assert sess.spares is None and len(sess.client.ids) == 2
    assert not old & {r.pid for r in sess.ranks}


def test_restart_while_the_spares_still_warm_up_stops_them_and_starts_fresh_engines(ipython):
    ip = ipython
    assert run(ip, "%mpnb start -n 2")[0].success
    sess = mpnb.session()
    assert wait_for(lambda: sess.spares is not None, timeout=60)  # launched, far from warm yet
    launched = sess.spares.before
    assert not spares.ready(sess)  # their processes have only just started
    res, out = run(ip, "%mpnb restart")
    assert res.success, out
    ranks = {r.engine_id for r in sess.ranks}
    assert len(ranks) == 2 and not ranks & launched
    res, out = run(ip, "%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t.item())")
    assert res.success and "2.0" in out, out
