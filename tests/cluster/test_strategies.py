"""Every strategy trains the tiny GPT like one process does: same seed, same global batch, 20 steps.

Runs on one real 2-engine CPU cluster (gloo, real DeepSpeed) shared by the
module. The reference is the same code in this process without a process
group. fp32 losses must agree to 1e-4 relative (SGD everywhere, AdamW where
stable); bf16 runs are compared with the fp32 reference within 2e-2, since
bf16 keeps 8 bits of mantissa (~4e-3 per rounding) in activations.
"""

from __future__ import annotations

import ipyparallel as ipp
import pytest

from .strategy_runs import assert_close, cluster_run, local_run

STEPS = 20
SGD = {"optim": "sgd", "lr": 0.1}
ADAMW = {"optim": "adamw", "lr": 1e-3}

# name -> config; micro_batch_size x ranks (x accumulation) = the global batch of 8 rows
SGD_CASES = {
    "ddp": {"strategy": "ddp", "micro_batch_size": 4},
    "fsdp": {"strategy": "fsdp", "micro_batch_size": 4},
    "fsdp-keep-gathered": {"strategy": "fsdp", "reshard_after_forward": False, "micro_batch_size": 4},
    "zero0": {"strategy": "zero", "zero_stage": 0, "micro_batch_size": 4},
    "zero1": {"strategy": "zero", "zero_stage": 1, "micro_batch_size": 4},
    "zero2": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4},
    "zero3": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 4},
    "pipeline-gpipe": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2,
                       "micro_batch_size": 8},
    "pipeline-1f1b": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 4,
                      "pipeline_schedule": "1f1b", "micro_batch_size": 8},
    "tensor": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 8},
    "ddp-accumulate": {"strategy": "ddp", "micro_batch_size": 2, "grad_accum_steps": 2},
    "zero2-accumulate": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 2, "grad_accum_steps": 2},
    "fsdp-checkpointing": {"strategy": "fsdp", "micro_batch_size": 4, "activation_checkpointing": True},
    "pipeline-checkpointing": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2,
                               "micro_batch_size": 8, "activation_checkpointing": True},
    "zero2-offload-optimizer": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4,
                                "offload": "optimizer"},
    "zero3-offload-parameters": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 4,
                                 "offload": "parameters"},
}
ADAMW_CASES = ["ddp", "fsdp", "zero1", "zero3", "pipeline-1f1b", "tensor"]
BF16_CASES = ["ddp", "fsdp", "zero2", "tensor"]


@pytest.fixture(scope="module")
def reference():
    return {
        "sgd": local_run(steps=STEPS, **SGD)["losses"],
        "adamw": local_run(steps=STEPS, **ADAMW)["losses"],
        "eval": local_run(steps=STEPS, **SGD)["eval"],
    }


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_losses_match_single_process(view, reference, case):
    results = cluster_run(view, SGD_CASES[case], steps=STEPS, **SGD)
    assert results[0]["losses"] == results[1]["losses"], "every rank reports the same global loss"
    assert_close(results[0]["losses"], reference["sgd"], rel=1e-4)
    assert results[0]["losses"][-1] < results[0]["losses"][0], "the model learns"
    assert results[0]["eval"] == pytest.approx(reference["eval"], rel=1e-4)


@pytest.mark.parametrize("case", ADAMW_CASES)
def test_adamw_losses_match_single_process(view, reference, case):
    results = cluster_run(view, SGD_CASES[case], steps=STEPS, **ADAMW)
    assert_close(results[0]["losses"], reference["adamw"], rel=1e-4)
    # trainer.parameter_counts(): the whole model on every rank, and what this rank holds of it
    # (model.num_parameters() says 0 under ZeRO-3, whose partitions sit in ds_tensor)
    n = results[0]["n_params"]
    assert [r["counts"][0] for r in results] == [n, n]
    held = [r["counts"][1] for r in results]
    if case in ("ddp", "zero1"):
        assert held == [n, n] and "all held on this rank" in results[0]["counts"][2]
    elif case == "tensor":  # the block matrices are split, embeddings and norms replicated
        assert all(n / 2 < h < n for h in held) and "tensor-parallel" in results[0]["counts"][2]
    else:  # zero3, fsdp: shards; pipeline: stages
        assert sum(held) == n and all(0 < h < n for h in held), held
        assert f"{held[0]:,} held on this rank" in results[0]["counts"][2]


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_stays_near_fp32(view, reference, case):
    results = cluster_run(view, {**SGD_CASES[case], "precision": "bf16"}, steps=STEPS, **SGD)
    losses = results[0]["losses"]
    assert losses != reference["sgd"], "bf16 really ran in lower precision"
    assert_close(losses, reference["sgd"], rel=2e-2)


def test_plain_sequential_under_ddp_and_pipeline(view):
    want = local_run(steps=10, model="mlp", batch=16, **SGD)["losses"]
    for cfg in ({"strategy": "ddp", "micro_batch_size": 8},
                {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2, "micro_batch_size": 16},
                {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 16}):
        got = cluster_run(view, cfg, steps=10, model="mlp", batch=16, **SGD)[0]["losses"]
        assert_close(got, want, rel=1e-4)


def test_huggingface_gpt2_from_config(view):
    pytest.importorskip("transformers")
    want = local_run(steps=5, hf=True, **SGD)["losses"]
    for cfg in ({"strategy": "ddp", "micro_batch_size": 4}, {"strategy": "fsdp", "micro_batch_size": 4},
                {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4}):
        got = cluster_run(view, cfg, steps=5, hf=True, **SGD)[0]["losses"]
        assert_close(got, want, rel=1e-4)


# ---- bad input: MpnbError on every rank before any collective, and the cluster stays usable --------
def _remote_errors(view, code: str) -> list[tuple[str, str]]:
    with pytest.raises(ipp.error.CompositeError) as info:
        view.execute(code, block=True)
    return [(e[0], e[1]) for e in info.value.elist]


def test_unsplittable_model_is_named_on_every_rank(view, reference):
    code = (
        "class Wide(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.body = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x): return self.body(x)\n"
        "mpnb.prepare(Wide(), config={'strategy': 'pipeline', 'pipeline_stages': 2, 'microbatches': 2})\n"
    )
    errors = _remote_errors(view, code)
    assert len(errors) == 2
    for name, message in errors:
        assert name == "MpnbError"
        assert "cannot split Wide" in message and "nn.Sequential" in message
    # nothing collective started, so the process group still works
    assert_close(cluster_run(view, SGD_CASES["ddp"], steps=3, **SGD)[0]["losses"], reference["sgd"][:3], 1e-4)


def test_tensor_plan_with_unknown_names_lists_close_ones(view):
    code = ("mpnb.prepare(tiny_gpt(0), config={'strategy': 'tensor', 'tensor_parallel': 2, "
            "'tensor_plan': {'blocks.*.mlp.fcc': 'colwise'}})")
    errors = _remote_errors(view, code)
    assert [e[0] for e in errors] == ["MpnbError", "MpnbError"]
    assert "blocks.*.mlp.fcc" in errors[0][1] and "matches no module" in errors[0][1]
