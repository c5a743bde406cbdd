"""How mpnb cuts and splits transformers models, in one process (no process group).

The pipeline stages of a causal LM, chained by hand, compute exactly what the
whole model computes, with the original parameter names; the plans and the
bad-input errors come from the model's own config. The same code under real
ranks: tests/cluster/test_hf_model_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from mpnb.engine.strategies import hf_pipeline
from mpnb.errors import MpnbError
from mpnb.hf_models import text_batches, tiny_transformer
from mpnb.planning import hf_plans


def _stages(family: str, starts: list[int]) -> list[torch.nn.Module]:
    layers = tiny_transformer(family).config.num_hidden_layers
    bounds = [*starts, layers]
    out = []
    for stage in range(len(starts)):
        model = tiny_transformer(family)  # same seed: every rank builds the same weights
        blocks = hf_pipeline.block_names(model, len(starts))
        out.append(hf_pipeline.split_hf_model(model, blocks, range(bounds[stage], bounds[stage + 1]),
                                              first=stage == 0, last=stage == len(starts) - 1))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chained_stages_compute_the_whole_models_logits_and_loss(family: str) -> None:
    whole = tiny_transformer(family)
    batch = next(text_batches(whole, batch_size=2, seq_len=12))
    batch["attention_mask"][1, :3] = 0  # a padded row: the mask must reach every stage
    want = whole(**batch)
    stages = _stages(family, [0, 1, 3])
    x = batch["input_ids"]
    for stage in stages:
        x = stage(x, attention_mask=batch["attention_mask"])
    torch.testing.assert_close(x, want.logits, rtol=0, atol=1e-5)
    stage_loss = hf_pipeline.StageLoss(stages[-1], None)
    torch.testing.assert_close(stage_loss(x, batch["labels"]), want.loss, rtol=0, atol=1e-6)
    stage_loss.own = False  # an (inputs, targets) pair: plain cross-entropy, as without a pipeline
    plain = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), batch["labels"].reshape(-1))
    torch.testing.assert_close(stage_loss(x, batch["labels"]), plain)


def test_stages_keep_their_layers_under_the_original_names() -> None:
    first, middle, last = _stages("llama", [0, 1, 3])
    names = [{n.split(".weight")[0] for n, _ in m.named_parameters()} for m in (first, middle, last)]
    assert "model.embed_tokens" in names[0] and "lm_head" not in names[0]
    assert {n.split(".")[2] for n in names[1]} == {"1", "2"}  # model.layers.1.*, model.layers.2.*
    assert "model.norm" in names[2] and "lm_head" in names[2] and "model.embed_tokens" not in names[2]
    whole = {n for n, _ in tiny_transformer("llama").named_parameters()}
    assert set().union(*[{n for n, _ in m.named_parameters()} for m in (first, middle, last)]) == whole


def test_a_tied_head_is_noticed_and_the_batch_checks_still_see_labels() -> None:
    assert hf_pipeline.tied_head(tiny_transformer("qwen2"))
    assert not hf_pipeline.tied_head(tiny_transformer("llama"))
    from mpnb.engine.batches import takes_labels

    assert takes_labels(_stages("qwen2", [0, 2])[1])  # the stage forward keeps the model's signature


def test_schedule_inputs_give_ids_to_the_first_stage_and_masks_to_all() -> None:
    batch = {"input_ids": torch.ones(2, 3), "attention_mask": torch.zeros(2, 3), "labels": torch.ones(2, 3)}
    args, kwargs = hf_pipeline.schedule_inputs(batch, first=True)
    assert args == (batch["input_ids"],) and list(kwargs) == ["attention_mask"]
    assert hf_pipeline.schedule_inputs(batch, first=False)[0] == ()


def test_pipeline_refuses_models_without_a_plan_and_too_many_stages() -> None:
    assert hf_plans.check_pipeline(tiny_transformer("llama"), 4) == ("model.layers", 4)
    with pytest.raises(MpnbError, match=r"pipeline_stages=5 is more than the 4 layers of LlamaFor"):
        hf_plans.check_pipeline(tiny_transformer("llama"), 5)
    for family, cls in [("gpt2", "GPT2LMHeadModel"), ("bert-mlm", "BertForMaskedLM")]:
        with pytest.raises(MpnbError, match=rf"{cls} has no pipeline plan.*strategy=fsdp or zero"):
            hf_plans.check_pipeline(tiny_transformer(family), 2)


def test_tensor_plans_come_from_transformers_or_mpnbs_encoder_plan() -> None:
    llama = tiny_transformer("llama")
    assert hf_plans.has_own_tensor_plan(llama)
    assert hf_plans.tensor_plan(llama)["model.layers.*.self_attn.k_proj"] == "colwise"
    bert = tiny_transformer("bert-cls")
    assert not hf_plans.has_own_tensor_plan(bert)
    assert hf_plans.tensor_plan(bert) == {
        "bert.encoder.layer.*.attention.self.query": "colwise",
        "bert.encoder.layer.*.attention.self.key": "colwise",
        "bert.encoder.layer.*.attention.self.value": "colwise",
        "bert.encoder.layer.*.attention.output.dense": "rowwise",
        "bert.encoder.layer.*.intermediate.dense": "colwise",
        "bert.encoder.layer.*.output.dense": "rowwise",
    }
    assert hf_plans.tensor_plan(tiny_transformer("gpt2")) is None


def test_transformers_expands_mpnbs_encoder_plan_to_every_layer() -> None:
    from mpnb.engine.strategies.hf_tensor import resolved_plan

    bert = tiny_transformer("bert-mlm")
    plan = resolved_plan(bert, 2)
    assert plan["bert.encoder.layer.3.attention.self.query.weight"] == "colwise"
    assert plan["bert.encoder.layer.0.output.dense"] == "rowwise"
    assert not any("LayerNorm" in name for name in plan)


def test_tensor_parallel_refuses_gpt2_and_heads_that_do_not_divide() -> None:
    from mpnb.engine.strategies.tensor import check_hf_model

    with pytest.raises(MpnbError, match=r"GPT2LMHeadModel has no tensor-parallel plan.*Conv1D.*fsdp or zero"):
        check_hf_model(tiny_transformer("gpt2"), 2)
    with pytest.raises(MpnbError, match="tensor_parallel=2 does not divide the 1 key/value heads"):
        check_hf_model(tiny_transformer("llama", num_key_value_heads=1), 2)
    check_hf_model(tiny_transformer("llama"), 2)
