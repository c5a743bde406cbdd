"""`mpnb.cluster.host_reach`: when a host counts as gone from the network (the end-to-end case, a
simulated host's link set down mid-cell, is in tests/cluster/test_ssh_hosts.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from mpnb.cluster import host_reach
from mpnb.cluster.session import RankInfo
from mpnb.monitoring.store import MemoryStore


def world(silent_s: float, address: str = "127.0.0.1"):
    """Two ranks on host A, two on host B; B's last samples arrived `silent_s` ago, A's just now."""
    formed = time.monotonic() - 60
    ranks = [RankInfo(rank=r, engine_id=r, host="host-a" if r < 2 else "host-b", pid=100 + r, device="cpu",
                      local_rank=r % 2, address=address, formed_at=formed) for r in range(4)]
    store = MemoryStore()
    store.add([{"rank": r, "t": 0.0, "used": 0} for r in range(4)])
    heard = store._heard
    for r in (2, 3):
        heard[r] -= silent_s
    return SimpleNamespace(ranks=ranks, memory=store)


def test_a_live_host_refuses_the_probe_at_once():
    assert host_reach._answers("127.0.0.1")


def test_a_silent_host_that_still_answers_is_not_cut_off():
    assert host_reach.unreachable(world(silent_s=10), range(4)) == {}


def test_a_silent_host_that_does_not_answer_is_cut_off_and_a_talking_one_never(monkeypatch):
    monkeypatch.setattr(host_reach, "_answers", lambda address: False)  # as 10.x behind a link that is down
    cut = host_reach.unreachable(world(silent_s=10, address="10.77.0.12"), range(4))
    assert sorted(cut) == [2, 3] and "its host (10.77.0.12) stopped answering 10 s ago" in cut[2]
    assert host_reach.unreachable(world(silent_s=1), range(4)) == {}  # heard from within SILENT_S
    assert sorted(host_reach.unreachable(world(silent_s=10), [3])) == [3]  # only the ranks asked about


def test_nothing_heard_from_anyone_is_not_blamed_on_a_host(monkeypatch):
    monkeypatch.setattr(host_reach, "_answers", lambda address: False)
    session = world(silent_s=10)
    for r in (0, 1):
        session.memory._heard[r] -= 10
    assert host_reach.unreachable(session, range(4)) == {}


def test_drop_watch_tells_when_a_host_drops_off_and_when_it_is_back(monkeypatch):
    """What the sidebar's flush thread asks each second: did the set of cut-off ranks move?"""
    monkeypatch.setattr(host_reach, "_answers", lambda address: False)
    session = world(silent_s=10, address="10.77.0.12")
    watch = host_reach.DropWatch(every=60)
    assert watch.changed(session) and watch.ranks == {2, 3}
    session.memory.add([{"rank": r, "t": 1.0, "used": 0} for r in (2, 3)])  # host B's samples again
    assert not watch.changed(session) and watch.ranks == {2, 3}  # judged at most every 60 s
    watch.every = 0
    assert watch.changed(session) and watch.ranks == frozenset()
    assert not watch.changed(session)
