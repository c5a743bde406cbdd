"""A state dict saved under one strategy loads under another and training continues exactly.

AdamW, so the optimizer state (moments, step count) must travel too, not only
the weights: 4 steps under strategy A, `trainer.state_dict()`, a fresh model
under strategy B, `load_state_dict`, 4 more steps; the losses of those must
equal steps 5-8 of one uninterrupted single-process run to 1e-4 relative.
One 2-engine CPU cluster for the module.
"""

from __future__ import annotations

import pytest
import torch

from .strategy_runs import ENGINE_CODE, assert_close, cluster_run, local_run

ADAMW = {"optim": "adamw", "lr": 1e-3}
CONFIGS = {
    "ddp": {"strategy": "ddp", "micro_batch_size": 4},
    "fsdp": {"strategy": "fsdp", "micro_batch_size": 4},
    "zero1": {"strategy": "zero", "zero_stage": 1, "micro_batch_size": 4},
    "zero2": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4},
    "zero3": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 4},
    "pipeline": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2, "micro_batch_size": 8},
    "tensor": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 8},
}
PAIRS = [("fsdp", "zero2"), ("zero3", "tensor"), ("ddp", "pipeline"), ("pipeline", "fsdp"),
         ("tensor", "zero1"), ("zero2", "ddp"), ("zero1", "zero3")]


@pytest.fixture(scope="module")
def reference():
    return local_run(steps=8, **ADAMW)["losses"]


@pytest.mark.parametrize(("saved", "loaded"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_state_dict_moves_between_strategies(view, reference, saved, loaded):
    first = cluster_run(view, CONFIGS[saved], steps=4, keep_state=True, **ADAMW)
    assert_close(first[0]["losses"], reference[:4], rel=1e-4)
    view.execute("mpnb_keys = sorted(mpnb_state['model'])", block=True)
    keys = view.pull("mpnb_keys", block=True)
    assert keys[0] == keys[1] == sorted(n for n, _ in _fresh_model().named_parameters())
    resumed = cluster_run(view, CONFIGS[loaded], steps=4, start=4, code={"load": "mpnb_state"}, **ADAMW)
    assert_close(resumed[0]["losses"], reference[4:], rel=1e-4)


def test_without_the_state_the_resumed_run_differs(view, reference):
    """The check above can fail: a fresh model on steps 5-8 gives other losses."""
    fresh = cluster_run(view, CONFIGS["fsdp"], steps=4, start=4, **ADAMW)
    assert abs(fresh[0]["losses"][0] - reference[4]) / reference[4] > 1e-3


def test_single_process_checkpoint_file_loads_on_the_cluster(view, reference, tmp_path):
    namespace: dict = {}
    exec(ENGINE_CODE, namespace)
    import mpnb

    torch.manual_seed(0)
    from mpnb.models import synthetic_batches, tiny_gpt

    net = tiny_gpt(0)
    trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), config={"strategy": "ddp"})
    for batch in synthetic_batches(batch_size=8, steps=4):
        trainer.step(batch)
    path = tmp_path / "ckpt.pt"
    torch.save(trainer.state_dict(), path)
    load = {"load": f"torch.load({str(path)!r})"}
    resumed = cluster_run(view, CONFIGS["zero3"], steps=4, start=4, code=load, **ADAMW)
    assert_close(resumed[0]["losses"], reference[4:], rel=1e-4)


def _fresh_model():
    from mpnb.models import tiny_gpt

    return tiny_gpt(0)
