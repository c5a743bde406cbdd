"""Compositions that need 4 ranks: tensor x data (FSDP2 on a 2-D mesh) and pipeline x data.

Same check as test_strategies.py: 20 steps, same seed and global batch, losses
equal to a single-process run to 1e-4 relative. One 4-engine CPU cluster for
the module. A transformers Llama (GQA) does the same compositions from its own
plans (transformers' TP on the "tp" dim, stages from `base_model_pp_plan`) on dict
batches: 5 AdamW steps, losses to 1e-4, memory per rank as `mpnb.estimate` says.
"""

from __future__ import annotations

import pytest

from . import hf_runs
from .strategy_runs import assert_close, cluster_run, install, local_run

STEPS = 20
SGD = {"optim": "sgd", "lr": 0.1}
ADAMW = {"optim": "adamw", "lr": 1e-3}
CASES = {
    # 2-way tensor parallel inside each pair of ranks, FSDP2 across the 2 pairs: 4 rows per pair
    "tensor-x-data": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 4},
    # 2 stages, each sharded over 2 data-parallel ranks
    "pipeline-x-data": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2,
                        "micro_batch_size": 4},
}


@pytest.fixture(scope="module")
def view():
    import mpnb
    from mpnb.cluster import lifecycle as cluster_mod

    cluster_mod.stop()
    sess = mpnb.start(n=4, timeout=60, verbose=False)
    try:
        v = sess.view()
        install(v)
        hf_runs.install(v)
        yield v
    finally:
        cluster_mod.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_composition_matches_single_process(view, case):
    want = local_run(steps=STEPS, **SGD)["losses"]
    results = cluster_run(view, CASES[case], steps=STEPS, **SGD)
    assert len({tuple(r["losses"]) for r in results}) == 1, "all 4 ranks report the same loss"
    assert_close(results[0]["losses"], want, rel=1e-4)
    # trainer.parameter_counts(): the whole model everywhere; each rank holds under half of it
    n = results[0]["n_params"]
    counts = [r["counts"] for r in results]
    assert all(total == n and held < n / 2 for total, held, _ in counts), counts
    if case == "pipeline-x-data":  # 2 stages x 2 FSDP shards: the 4 parts are the model
        assert sum(held for _, held, _ in counts) == n


def test_tensor_x_data_with_adamw_and_quarter_memory(view):
    want = local_run(steps=STEPS, **ADAMW)
    results = cluster_run(view, CASES["tensor-x-data"], steps=STEPS, **ADAMW)
    assert_close(results[0]["losses"], want["losses"], rel=1e-4)
    # TP halves the block matrices, FSDP2 halves everything again: well under half of the model per rank
    psi = want["n_params"]
    for r in results:
        assert r["breakdown"]["parameters"] < 4 * psi / 2
        assert r["breakdown"]["optimizer"] == pytest.approx(2 * r["breakdown"]["parameters"], rel=0.01)


HF_CASES = {
    "llama-tensor-x-data": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 4},
    "llama-pipeline-x-data": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2,
                              "micro_batch_size": 4},
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_llama_composition_matches_single_process(view, case):
    results = hf_runs.cluster_hf_run(view, HF_CASES[case], family="llama")
    assert len({tuple(r["losses"]) for r in results}) == 1, "all 4 ranks report the same loss"
    assert_close(results[0]["losses"], hf_runs.local_hf_run(family="llama")["losses"], rel=1e-4)
    hf_runs.assert_estimate_agrees(results, 0.05)
