"""transformers models under tensor and pipeline parallelism, from the plans the models ship.

One real 2-engine CPU cluster (gloo) for the module. Llama (GQA: 4 heads, 2
key/value heads) and Qwen2 (tied embeddings, q/k/v bias) train 5 AdamW steps on
the same global dict batches with the model's own loss under transformers' own
tensor parallelism (tp=2) and under a 2-stage pipeline cut where
`config.base_model_pp_plan` says (GPipe and 1F1B, attention masks carried to
both stages); the first 5 losses must equal `local_hf_run` (one process) to 1e-4
relative in fp32. The per-rank memory is then compared with `mpnb.estimate`
without training again. Bad input (heads that do not divide, more stages than
layers, models without a plan) fails with one MpnbError on both ranks before any
collective, and the next run trains.
"""

from __future__ import annotations

from typing import Any

import pytest
from ipyparallel.error import CompositeError

from . import hf_runs
from .strategy_runs import assert_close

pytest.importorskip("transformers")

STRATEGIES: dict[str, dict[str, Any]] = {
    "tensor": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 8},
    "pipeline-gpipe": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2,
                       "micro_batch_size": 8},
    "pipeline-1f1b": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 4, "micro_batch_size": 8,
                      "pipeline_schedule": "1f1b"},
}
CASES = {f"{family}-{s}": (family, cfg) for family in ("llama", "qwen2") for s, cfg in STRATEGIES.items()}
RUNS = hf_runs.CachedRuns(CASES)


@pytest.fixture(scope="module")
def view(cluster):
    v = cluster.view()
    hf_runs.install(v)
    return v


@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_single_process(view, case):
    family, _ = CASES[case]
    results = RUNS.results(view, case)
    losses = results[0]["losses"]
    assert len(losses) == 5 and results[1]["losses"] == losses, "every rank reports the same global loss"
    assert_close(losses, RUNS.reference(family), rel=1e-4)
    # each rank holds part of the model: TP shards the projections, a stage keeps half of the layers
    for result in results:
        assert 0 < result["breakdown"]["parameters"] < 0.75 * results[0]["estimate"]["parameters"] * 2


@pytest.mark.parametrize("case", list(CASES))
def test_memory_matches_estimate(view, case):
    hf_runs.assert_estimate_agrees(RUNS.results(view, case), 0.05)


BAD = {  # id -> (family, config, overrides, words of the message)
    "kv-heads-do-not-divide": ("llama", STRATEGIES["tensor"], {"num_key_value_heads": 1},
                               ["tensor_parallel=2 does not divide the 1 key/value heads",
                                "LlamaForCausalLM"]),
    "more-stages-than-layers": ("qwen2", STRATEGIES["pipeline-gpipe"], {"num_hidden_layers": 1},
                                ["pipeline_stages=2 is more than the 1 layer of Qwen2ForCausalLM"]),
    "gpt2-tensor": ("gpt2", STRATEGIES["tensor"], None,
                    ["GPT2LMHeadModel has no tensor-parallel plan", "Conv1D", "strategy=fsdp or zero"]),
    "gpt2-pipeline": ("gpt2", STRATEGIES["pipeline-gpipe"], None,
                      ["GPT2LMHeadModel has no pipeline plan", "strategy=fsdp or zero"]),
    "bert-pipeline": ("bert-mlm", STRATEGIES["pipeline-1f1b"], None,
                      ["BertForMaskedLM has no pipeline plan", "strategy=fsdp or zero"]),
}


def test_bad_input_fails_on_every_rank_and_the_cluster_trains_next(view):
    for case, (family, config, overrides, words) in BAD.items():
        with pytest.raises(CompositeError) as info:
            hf_runs.cluster_hf_run(view, config, family=family, overrides=overrides)
        errors = info.value.elist
        assert len(errors) == 2, (case, errors)  # both ranks, the same error
        for name, message, *_ in errors:
            assert name == "MpnbError" and all(w in message for w in words), (case, message)
    # the process group still works: a tensor-parallel run right after trains as one process does
    results = hf_runs.cluster_hf_run(view, STRATEGIES["tensor"], family="llama", steps=2)
    assert_close(results[0]["losses"], RUNS.reference("llama")[:2], rel=1e-4)


def test_bert_splits_with_mpnbs_encoder_plan(view):
    results = hf_runs.cluster_hf_run(view, STRATEGIES["tensor"], family="bert-cls", steps=3)
    want = hf_runs.local_hf_run(family="bert-cls", steps=3)["losses"]
    assert_close(results[0]["losses"], want, rel=1e-4)
