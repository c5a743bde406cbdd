"""A checkpoint written on 2 ranks resumes on 4 and the other way (FSDP, ZeRO-3, tensor x data).

DCP reads each rank's new piece from whichever saved chunks overlap it, so a
run moves to another world size with the same next losses (AdamW, fp32, 1e-5
relative to one uninterrupted single-process run). Clusters in turn: 2 engines
write, 4 engines read and write, 2 engines read.
"""

from __future__ import annotations

import pytest

from mpnb.checkpoints.format import read_manifest
from tests.helpers import own_cluster

from .strategy_runs import assert_close, cluster_run, install, local_run, save_after_steps

pytestmark = pytest.mark.timeout(600)

ADAMW = {"optim": "adamw", "lr": 1e-3}
REL = 1e-5
SHARDED = {
    "fsdp": {"strategy": "fsdp", "micro_batch_size": 2},
    "zero3": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 2},
}
TENSOR_X_DATA = {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 4}  # 4 ranks: 2 x 2


@pytest.fixture(scope="module")
def reference():
    return local_run(steps=9, **ADAMW)["losses"]


def _assert_resumes(view, path, config, reference, world):
    resumed = cluster_run(view, config, steps=5, start=4, resume=str(path), **ADAMW)
    assert len(resumed) == world and len({tuple(r["losses"]) for r in resumed}) == 1
    assert_close(resumed[0]["losses"], reference[4:], rel=REL)


@pytest.fixture(scope="module")
def on_two(tmp_path_factory, reference):
    folder = tmp_path_factory.mktemp("two")
    with own_cluster(n=2) as sess:
        view = sess.view()
        install(view)
        return save_after_steps(view, folder, SHARDED, reference[:4], **ADAMW)


@pytest.fixture(scope="module")
def four(on_two):
    with own_cluster(n=4, timeout=60) as sess:
        view = sess.view()
        install(view)
        yield view


def test_two_ranks_resume_on_four(four, on_two, reference):
    for path in on_two.values():
        assert read_manifest(path)["world_size"] == 2
        for config in [*SHARDED.values(), TENSOR_X_DATA]:
            _assert_resumes(four, path, config, reference, world=4)


@pytest.fixture(scope="module")
def on_four(four, tmp_path_factory, reference):
    configs = {**SHARDED, "tensor-x-data": TENSOR_X_DATA}
    return save_after_steps(four, tmp_path_factory.mktemp("four"), configs, reference[:4], **ADAMW)


def test_four_ranks_resume_on_two(on_four, reference):
    """Runs after the 4-rank tests: starting 2 engines stops the 4."""
    with own_cluster(n=2) as sess:
        view = sess.view()
        install(view)
        for path in on_four.values():
            assert read_manifest(path)["world_size"] == 4
            for config in SHARDED.values():
                _assert_resumes(view, path, config, reference, world=2)
