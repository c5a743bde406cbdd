"""Ranks are assigned from engine metadata (host, visible GPUs), grouped by host, whatever the engine ids."""

from __future__ import annotations

import pytest

from mpnb.cluster.launch import WorldPlan
from mpnb.cluster.ranks import assign_ranks
from mpnb.errors import ClusterError


def _info(host: str, pid: int, gpus: list[int]) -> dict:
    return {"host": host, "pid": pid, "ip": "10.0.0.1", "gpus": gpus, "free_port": 1234}


def test_ranks_are_grouped_by_host_whatever_the_engine_ids():
    # Engines registered in an interleaved order across two hosts (what a Slurm launch looks like).
    infos = {
        0: _info("node-b", 300, [0, 1]),
        1: _info("node-a", 200, [0, 1]),
        2: _info("node-b", 100, [0, 1]),
        3: _info("node-a", 400, [0, 1]),
    }
    rows = assign_ranks(infos, WorldPlan(backend=None, timeout_s=60, port=None, devices=None))
    table = [(r["rank"], r["info"]["host"], r["local_rank"], r["local_world_size"], r["gpu"],
              r["group_rank"], r["group_world_size"]) for r in rows]
    assert table == [
        (0, "node-a", 0, 2, 0, 0, 2),
        (1, "node-a", 1, 2, 1, 0, 2),
        (2, "node-b", 0, 2, 0, 1, 2),
        (3, "node-b", 1, 2, 1, 1, 2),
    ]
    assert [r["engine_id"] for r in rows] == [1, 3, 2, 0]


def test_engines_that_each_see_one_gpu_keep_it_and_too_few_gpus_is_an_error():
    infos = {0: _info("h", 2, [5]), 1: _info("h", 1, [3])}  # a launcher set CUDA_VISIBLE_DEVICES per engine
    rows = assign_ranks(infos, WorldPlan(backend=None, timeout_s=60, port=None, devices=None))
    assert [(r["rank"], r["gpu"]) for r in rows] == [(0, 3), (1, 5)]
    crowded = {0: _info("h", 1, [0, 1]), 1: _info("h", 2, [0, 1]), 2: _info("h", 3, [0, 1])}
    with pytest.raises(ClusterError, match="runs 3 engines but sees only 2 GPUs"):
        assign_ranks(crowded, WorldPlan(backend=None, timeout_s=60, port=None, devices=None))
