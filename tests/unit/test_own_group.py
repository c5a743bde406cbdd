"""Whether a cell's `init_process_group(...)` fits mpnb's live group (`group_request`, pure data), and
`own_group` in a real one-rank world in a subprocess (so torch's patched function stays out of pytest)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mpnb.engine.group_request import InitRequest, RunningGroup, incompatibility, parse_backends, same_host

GLOO = RunningGroup(backends={"cpu": "gloo", "cuda": "gloo"}, rank=1, world_size=2, master_addr="127.0.0.1")
NCCL_GPU = RunningGroup(
    backends={"cuda": "nccl"}, rank=0, world_size=4, master_addr="10.1.2.3", device_type="cuda"
)


def test_backend_strings_name_a_backend_per_device():
    assert parse_backends("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert parse_backends("NCCL") == {"cuda": "nccl"}
    assert parse_backends("cpu:gloo, cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backends("undefined") == {}


@pytest.mark.parametrize(
    "request_",
    [
        InitRequest(),
        InitRequest(backend="gloo"),
        InitRequest(backend="cpu:gloo,cuda:nccl"),  # the cuda part does not matter on a CPU engine
        InitRequest(backend="undefined", init_method="env://"),
        InitRequest(backend="gloo", rank=1, world_size=2),
        InitRequest(init_method="tcp://localhost:29500"),  # any port: the same processes meet
        InitRequest(init_method="tcp://127.0.0.1:1234?rank=1&world_size=2"),
        InitRequest(init_method="file:///tmp/rendezvous", world_size=2),
    ],
)
def test_requests_mpnbs_cpu_group_serves(request_):
    assert incompatibility(request_, GLOO) is None


@pytest.mark.parametrize(
    ("request_", "named"),
    [
        (InitRequest(world_size=3), "world_size=3 (mpnb's group has 2 ranks)"),
        (InitRequest(rank=0, world_size=2), "rank=0 (this engine is rank 1)"),
        (InitRequest(init_method="tcp://127.0.0.1:1?rank=0"), "rank=0 (this engine is rank 1)"),
        (InitRequest(init_method="env://?world_size=8"), "world_size=8"),
        (
            InitRequest(init_method="tcp://10.0.0.1:1"),
            "init_method 'tcp://10.0.0.1:1' (mpnb's group meets at",
        ),
        (InitRequest(backend="nccl"), "backend 'nccl' (mpnb's group: cpu:gloo,cuda:gloo)"),
        (InitRequest(backend="cpu:mpi"), "backend 'cpu:mpi'"),
        (InitRequest(store=True, rank=1, world_size=2), "a store of its own"),
        (InitRequest(init_method="mpi://"), "init_method 'mpi://'"),
    ],
)
def test_requests_for_another_world_name_the_difference(request_, named):
    problem = incompatibility(request_, GLOO)
    assert problem is not None and named in problem, problem


def test_every_difference_is_named():
    problem = incompatibility(InitRequest(backend="nccl", rank=0, world_size=3), GLOO)
    assert problem is not None
    assert [p.split(" ")[0] for p in problem.split("; ")] == ["backend", "world_size=3", "rank=0"]


def test_a_gpu_world_on_nccl():
    assert incompatibility(InitRequest(backend="nccl", rank=0, world_size=4), NCCL_GPU) is None
    assert incompatibility(InitRequest(init_method="tcp://10.1.2.3:29500"), NCCL_GPU) is None
    problem = incompatibility(InitRequest(backend="gloo"), NCCL_GPU)  # no cpu backend in mpnb's group
    assert problem is not None and "backend 'gloo'" in problem
    problem = incompatibility(InitRequest(init_method="tcp://localhost:29500"), NCCL_GPU)  # not rank 0's host
    assert problem is not None and "init_method" in problem


def test_the_rendezvous_host_by_any_name():
    assert same_host("localhost", GLOO) and same_host("[::1]", GLOO) and same_host("127.0.0.2", GLOO)
    assert not same_host("10.0.0.1", GLOO)
    named = RunningGroup(backends={}, rank=0, world_size=1, master_addr="127.0.0.1", hosts=frozenset({"box"}))
    assert same_host("box", named) and not same_host("other", named)


# A one-rank world, formed as bootstrap.setup forms one, then what a cell or a script would do.
ONE_RANK = textwrap.dedent(
    """
    import datetime, os
    import torch, torch.distributed as dist
    from mpnb.engine import bootstrap, own_group, rendezvous, state
    from mpnb.errors import ConfigError, RankError

    port = bootstrap.free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    state.rank, state.world_size, state.master_addr, state.master_port = 0, 1, "127.0.0.1", port
    state.backend, state.timeout_s = "gloo", 20.0
    store = rendezvous.store(0, 1, "127.0.0.1", port, datetime.timedelta(seconds=20))
    own_group.real_init_process_group("gloo", store=store, rank=0, world_size=1)
    own_group.install(store)
    own_group.before_cell(collective=True)

    dist.init_process_group("gloo", rank=0)  # the note, once
    dist.init_process_group()
    try:
        dist.init_process_group(world_size=2)
    except ConfigError as e:
        print("refused:", e)
    print("same function everywhere:", dist.distributed_c10d.init_process_group is dist.init_process_group,
          dist.device_mesh.init_process_group is dist.init_process_group)

    with own_group.script_owns_group():
        print("parked:", dist.is_initialized(), os.environ["MASTER_PORT"] != str(port))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=9))
        inner = dist.distributed_c10d._get_default_store().underlying_store
        print("script's store on:", inner.host, inner.port != port)
        dist.destroy_process_group()
    print("back:", dist.is_initialized(), dist.get_world_size(), state.master_port != port,
          os.environ["MASTER_PORT"] == str(state.master_port))

    try:
        with own_group.script_owns_group():
            dist.init_process_group("gloo")
            raise ValueError("boom")
    except ValueError as e:
        print("script's error kept:", e, dist.is_initialized())

    dist.destroy_process_group()
    own_group.before_cell(collective=False)
    print("subset cell:", dist.is_initialized())
    own_group.before_cell(collective=True)
    print("all ranks:", dist.is_initialized())

    state.backend = "nccl"  # not built into this torch: forming mpnb's group again fails
    try:
        with own_group.script_owns_group():
            raise ValueError("script failed")
    except RankError as e:
        print("rank error:", e)
        print("cause:", repr(e.__cause__))
    try:  # the next cell on every rank tries again (no IPython here: the hook raises itself)
        own_group.before_cell(collective=True)
    except RankError as e:
        print("next cell:", type(e.__cause__).__name__, dist.is_initialized())
    """
)


def test_own_group_in_a_one_rank_world():
    done = subprocess.run(
        [sys.executable, "-c", ONE_RANK], capture_output=True, text=True, timeout=120, env=_env()
    )
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, out + err
    note = (
        "mpnb: init_process_group() uses mpnb's process group (gloo, 1 rank) already formed on these engines."
    )
    assert out.count(note) == 1, out
    assert "refused: init_process_group() asks for another process group" in out
    assert "world_size=2 (mpnb's group has 1 rank)" in out and "`%mpnb run script.py`" in out
    assert "same function everywhere: True True" in out
    assert "parked: False True" in out
    assert "script's store on: 127.0.0.1 True" in out
    assert "back: True 1 True True" in out
    assert "script's error kept: boom True" in out
    assert "subset cell: False" in out and "all ranks: True" in out
    assert err.count("this cell does not run on every rank, so it is not formed again here") == 1, err
    assert out.count("mpnb: process group re-formed (it was destroyed in an earlier cell).") == 1, out
    assert "rank error: mpnb could not form its process group again" in out
    assert "`%mpnb heal`" in out and "`%mpnb restart`" in out
    assert "cause: ValueError('script failed')" in out
    assert "next cell: RuntimeError False" in out


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}
