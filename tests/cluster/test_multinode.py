"""Ranks on two simulated hosts (network namespaces, `simulated_hosts.py`), attached with `mpnb.connect`.

Run twice: once where the host names resolve on every host, once where they do not (containers,
fresh nodes), which is where gloo used to fall back to 127.0.0.1 and every peer refused it.
"""

from __future__ import annotations

import os
import re
import time

import pytest

import mpnb
from tests.helpers import run

from .simulated_hosts import HOSTS, simulated_hosts, skip_reason
from .strategy_runs import assert_close, cluster_run, install, local_run
from .test_security_sockets import LISTEN, address

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(skip_reason() is not None, reason=f"SKIPPED LOUDLY: {skip_reason()}"),
]

WORLD = 2 * len(HOSTS)


@pytest.fixture(scope="module", params=["names-do-not-resolve", "names-resolve"])
def hosts(request, tmp_path_factory):
    resolve = request.param == "names-resolve"
    with simulated_hosts(tmp_path_factory.mktemp("hosts"), names_resolve=resolve) as h:
        yield h


@pytest.fixture(scope="module")
def session(hosts):
    t0 = time.perf_counter()
    sess = mpnb.connect(str(hosts.profile_dir), hosts.cluster_id, timeout=30, verbose=False)
    sess.ready_seconds = time.perf_counter() - t0
    try:
        yield sess
    finally:
        mpnb.stop()


@pytest.fixture(scope="module")
def view(session):
    v = session.view()
    install(v)
    return v


ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
       "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def test_ranks_are_grouped_by_host_with_torchrun_variables_and_the_routed_interface(session, view, hosts):
    view.execute(
        "import os, socket, psutil\n"
        f"seen = (socket.gethostname(), {{k: os.environ.get(k) for k in {ENV!r}}},\n"
        "        {n: [a.address for a in v] for n, v in psutil.net_if_addrs().items()})",
        block=True,
    )
    seen = view.pull("seen", block=True)
    host_names = sorted(HOSTS)
    rank0_addr = hosts.addresses[host_names[0]]
    for rank, (host, env, interfaces) in enumerate(seen):
        node = rank // 2
        assert host == host_names[node], seen
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank % 2), env
        assert env["WORLD_SIZE"] == str(WORLD) and env["LOCAL_WORLD_SIZE"] == "2", env
        assert env["GROUP_RANK"] == str(node) and env["GROUP_WORLD_SIZE"] == str(len(HOSTS)), env
        assert env["MASTER_ADDR"] == rank0_addr, env  # routed, never 127.0.0.1 across hosts
        ifname = env["GLOO_SOCKET_IFNAME"]
        assert hosts.addresses[host] in interfaces[ifname], (ifname, interfaces)
        assert env["NCCL_SOCKET_IFNAME"] == ifname
    assert [r.host for r in session.ranks] == [h for h in host_names for _ in range(2)]
    assert session.ready_seconds < 60


def test_a_collective_and_ddp_and_fsdp_training_across_hosts_equal_one_process(view):
    view.execute("t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); total = t.item()", block=True)
    assert view.pull("total", block=True) == [float(sum(range(1, WORLD + 1)))] * WORLD
    want = local_run(steps=4)["losses"]
    for strategy in ("ddp", "fsdp"):  # FSDP: each host holds half of every parameter, gathered across
        got = cluster_run(view, {"strategy": strategy}, steps=4)
        for result in got:
            assert_close(result["losses"], want, rel=1e-5)


def listening_addresses(pid: int) -> set[str]:
    """Where process `pid` listens, from its own network namespace's /proc/PID/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.add(address(fields[1])[0])
    return found


def test_no_rank_listens_on_every_interface(session, hosts):
    """The store on rank 0 and gloo's own sockets bind the host's routed address only."""
    listening = {r.rank: listening_addresses(r.pid) for r in session.ranks}
    for r in session.ranks:
        assert listening[r.rank] <= {hosts.addresses[r.host], "127.0.0.1"}, listening
    assert hosts.addresses[session.ranks[0].host] in listening[0], listening  # the group's store


def test_memory_samples_arrive_from_every_host(session, view):
    view.execute("x = torch.ones(1 << 20); time_mark = 1", block=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(session.memory.latest()) < WORLD:
        time.sleep(0.2)
    assert sorted(session.memory.latest()) == list(range(WORLD))


RANK_0_FAILS_WHILE_THE_OTHERS_WAIT = (
    "%%distributed --no-monitor\n"
    "import time\n"
    "t = torch.ones(1)\n"
    "if rank == 0:\n"
    "    time.sleep(0.5)\n"
    "    raise ValueError('bad batch on rank 0')\n"
    "dist.all_reduce(t)\n"
)


def test_a_failure_on_one_host_releases_the_ranks_on_the_other_and_heal_is_quick(ipython, session):
    """The group's own connections are shut down on every rank that returns, so ranks on host B,
    which no same-host release reaches, fail at once instead of at the group's timeout."""
    for _ in range(2):  # the second time also after a heal
        res, out = run(ipython, RANK_0_FAILS_WHILE_THE_OTHERS_WAIT)
        assert type(res.error_in_exec).__name__ == "CellFailedError", out
        assert "rank 0 failed first: ValueError: bad batch on rank 0" in out
        assert f"released ranks 1-{WORLD - 1}" in out and "may still be blocked" not in out, out
        for rank in range(2, WORLD):  # on the other host: read back through their engines, not a path
            block = out.split(f"  [rank {rank}]\n", 1)[-1].split("  [rank ", 1)[0]
            assert re.match(r"  Cell In\[\d+\], line 7\n", block) and "in all_reduce" in block, out
        assert "stack written on" not in out, out
        t0 = time.perf_counter()
        res, out = run(ipython, "%mpnb heal")
        assert res.success and f"rebuilt on {WORLD} ranks" in out, out
        assert time.perf_counter() - t0 < 10  # waiting out the group's timeout took 21-52 s
    res, out = run(ipython, "%%distributed\nt = torch.ones(1); dist.all_reduce(t); print(int(t.item()))\n")
    assert res.success and f"[ranks 0-{WORLD - 1}] {WORLD}" in out, out


def test_an_engine_killed_on_the_other_host_is_reported_with_its_host(ipython, session):
    code = ("%%distributed --no-monitor\nimport os, time\n"
            "if rank == 3:\n    os.kill(os.getpid(), 9)\ntime.sleep(30)\n")
    t0 = time.perf_counter()
    res, out = run(ipython, code)
    assert time.perf_counter() - t0 < 15, out  # the others' 30 s sleep is cut short
    assert type(res.error_in_exec).__name__ == "CellFailedError", out
    assert f"rank 3 (pid {session.ranks[3].pid} on {sorted(HOSTS)[1]})" in out and "gone" in out, out
