"""mpnb.estimate on Hugging Face transformers models built in-process from tiny configs (no cluster).

What each rank holds under every strategy is checked against the trainers on a
cluster (tests/cluster/hf_runs.py `assert_estimate_agrees`); here: what the
estimator reads from the config and the modules, against counts by hand and
what autograd really saves.
"""

from __future__ import annotations

import pytest

from mpnb import Config, estimate
from mpnb.hf_models import VOCAB, text_batches, tiny_transformer

FAMILIES = ["llama", "qwen2", "gpt2", "bert-mlm", "bert-cls"]


def unique_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_tied_embeddings_are_one_parameter_except_across_pipeline_stages() -> None:
    tied = tiny_transformer("qwen2")
    untied = tiny_transformer("qwen2", tie_word_embeddings=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    table = VOCAB * tied.config.hidden_size
    assert estimate(tied, Config(), 1).num_params == unique_params(tied)
    assert estimate(untied, Config(), 1).num_params == estimate(tied, Config(), 1).num_params + table
    # two stages: the first holds the embedding, the last the head, so both hold the tied table
    pipe = Config(strategy="pipeline", pipeline_stages=2, microbatches=2)
    stages = [r.parameters // 4 for r in estimate(tied, pipe, 2).ranks]
    assert sum(stages) == unique_params(tied) + table
    assert stages == [r.parameters // 4 for r in estimate(untied, pipe, 2).ranks]


def test_gqa_key_value_heads_change_parameters_and_activations_as_the_config_says() -> None:
    gqa = tiny_transformer("llama")  # 4 query heads, 2 key/value heads
    mha = tiny_transformer("llama", num_key_value_heads=4)
    c = gqa.config
    head_dim = c.hidden_size // c.num_attention_heads
    # k_proj and v_proj: (kv heads * head_dim) x hidden each, per layer
    extra = c.num_hidden_layers * 2 * (4 - 2) * head_dim * c.hidden_size
    assert estimate(mha, Config(), 1).num_params - estimate(gqa, Config(), 1).num_params == extra
    s, b = 32, 8
    small = estimate(gqa, Config(micro_batch_size=b), 1, seq_len=s)
    full = estimate(mha, Config(micro_batch_size=b), 1, seq_len=s)
    # K and V each keep s*b*(kv heads * head_dim) values per layer, in fp32
    assert full.activations - small.activations == c.num_hidden_layers * 2 * s * b * (4 - 2) * head_dim * 4
    assert "GQA 4/2 heads" in small.activation_formula and "GQA" not in full.activation_formula


@pytest.mark.parametrize(("family", "words"), [
    ("llama", ["LlamaForCausalLM", "Llama-style decoder", "GQA 4/2 heads", "SwiGLU", "intermediate 64",
               "RMSNorm", "V = 256", "Korthikanti"]),
    ("qwen2", ["Qwen2ForCausalLM", "Llama-style decoder", "SwiGLU"]),
    ("gpt2", ["GPT2LMHeadModel", "decoder", "4 heads", "gelu_new", "intermediate 128", "LayerNorm"]),
    ("bert-mlm", ["BertForMaskedLM", "encoder", "gelu", "LM head", "before the layers"]),
    ("bert-cls", ["BertForSequenceClassification", "pooled classifier head"]),
])
def test_the_result_names_the_activation_formula(family: str, words: list[str]) -> None:
    est = estimate(tiny_transformer(family), Config(), 1)
    for word in words:
        assert word in est.activation_formula, (word, est.activation_formula)
    assert f"activations: {est.activation_formula}" in est.notes
    assert est.as_dict()["activation_formula"] == est.activation_formula
    if family == "bert-cls":  # pooled: no per-token vocabulary term
        assert "V =" not in est.activation_formula


@pytest.mark.parametrize("precision", ["fp32", "bf16-module", "bf16-autocast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activations_match_what_autograd_saves(family: str, precision: str) -> None:
    """One forward + backward with the model's own loss: the formula is within 12% of the saved tensors.

    bf16 as FSDP2 and DeepSpeed run it: the module itself in bf16 (RMSNorm still computes in fp32, the
    causal-LM loss upcasts its logits); as DDP runs it: torch autocast, which keeps the residual stream
    in fp32 and casts each projection's input (and weight: not counted, said in a note) to bf16.
    """
    import contextlib

    import torch

    from mpnb.engine.activations import LiveActivationMeter

    model = tiny_transformer(family)
    s, b = 32, 8
    strategy = "ddp" if precision == "bf16-autocast" else "fsdp"
    cfg = Config(strategy=strategy, micro_batch_size=b, precision=precision[:4])
    est = estimate(model, cfg, 1, seq_len=s)
    if precision == "bf16-module":
        model = model.to(torch.bfloat16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if strategy == "ddp" else contextlib.nullcontext()
    batch = next(text_batches(model, b, s, 1))
    with LiveActivationMeter() as meter:
        with autocast:
            loss = model(**batch).loss
        loss.backward()
    assert est.activations == pytest.approx(meter.peak_bytes, rel=0.12)
    assert any("autocast" in note for note in est.notes) == (precision == "bf16-autocast")


def test_llama_tensor_plan_splits_the_projections_embedding_and_head() -> None:
    model = tiny_transformer("llama")
    n = unique_params(model)
    layers = model.model.layers
    projections = sum(
        getattr(block.self_attn, name).weight.numel() for block in layers for name in ("q_proj", "k_proj",
                                                                                       "v_proj", "o_proj")
    ) + sum(getattr(block.mlp, name).weight.numel() for block in layers for name in ("gate_proj", "up_proj",
                                                                                      "down_proj"))
    table = model.model.embed_tokens.weight.numel()
    split = projections + 2 * table  # embed_tokens (vocab rows) and lm_head (colwise) too; norms stay whole
    tp = estimate(model, Config(strategy="tensor", tensor_parallel=2), 2)
    # gradients follow their parameter's layout (the engine re-shards the embedding's replicated gradient)
    assert tp.parameters == tp.gradients == 4 * (n - split // 2)
    assert tp.optimizer == 8 * (n - split // 2)
    tp_dp = estimate(model, Config(strategy="tensor", tensor_parallel=2), 4)  # then FSDP2 shards it all
    assert tp_dp.parameters == tp_dp.gradients == 4 * (n - split // 2) // 2


def test_qwen2_tied_head_is_split_once() -> None:
    model = tiny_transformer("qwen2")
    n = unique_params(model)
    split = model.model.embed_tokens.weight.numel()  # embed_tokens and lm_head: one table, split once
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        split += sum(m.weight.numel() + m.bias.numel() for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        split += attn.o_proj.weight.numel()  # rowwise: no bias
        split += sum(m.weight.numel() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    tp = estimate(model, Config(strategy="tensor", tensor_parallel=2), 2)
    assert tp.parameters == 4 * (n - split // 2)
    assert tp.gradients == tp.parameters


def test_more_layers_more_activations_and_higher_zero_stages_hold_less() -> None:
    two = estimate(tiny_transformer("llama", num_hidden_layers=2), Config(), 1)
    four = estimate(tiny_transformer("llama"), Config(), 1)
    assert four.activations > two.activations > 0
    model = tiny_transformer("llama")
    held = [estimate(model, Config(strategy="zero", zero_stage=z), 4).model_states for z in (1, 2, 3)]
    assert held[0] > held[1] > held[2]


def test_offloaded_states_are_still_held_by_the_rank() -> None:
    """`held()` counts what `memory_breakdown()` reads: device plus CPU bytes of each category."""
    model = tiny_transformer("llama")
    on = estimate(model, Config(strategy="zero", zero_stage=2), 2).ranks[0]
    off = estimate(model, Config(strategy="zero", zero_stage=2, offload="optimizer"), 2).ranks[0]
    assert off.optimizer == 0 and off.gradients == 0 and off.offloaded == on.optimizer + on.gradients
    assert off.held() == on.held() == {"parameters": on.parameters, "gradients": on.gradients,
                                       "optimizer": on.optimizer}


def test_single_process_trainer_holds_what_the_estimate_says() -> None:
    """A tied Qwen2 trained one step on a dict batch with its own loss, as a transformers user does."""
    import torch

    import mpnb

    model = tiny_transformer("qwen2")
    est = estimate(model, Config(), 1)
    trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=Config())
    trainer.step(next(text_batches(model, 8, 32, 1)))
    held = trainer.memory_breakdown()
    for key, predicted in est.ranks[0].held().items():
        assert held[key] == pytest.approx(predicted, rel=0.05), key
