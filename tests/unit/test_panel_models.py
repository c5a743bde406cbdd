"""Which strategies a model supports: `strategy_support`, the panel for an HF model, `%mpnb config --model`.

Real tiny transformers models (random weights, nothing downloaded) and mpnb's own
models, real ipywidgets objects in-process (no browser), a real IPython shell.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

import mpnb
from mpnb.errors import ConfigError
from mpnb.hf_models import tiny_transformer
from mpnb.models import mlp, tiny_gpt
from mpnb.planning.config import Config
from mpnb.planning.model_support import STRATEGIES, check_config, describe_support, strategy_support

NO_TP = "has no tensor-parallel plan (transformers' config.base_model_tp_plan)"
NO_PP = "has no pipeline plan (transformers' config.base_model_pp_plan)"


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {f: tiny_transformer(f) for f in ("llama", "qwen2", "gpt2", "bert-mlm", "bert-cls")}


@pytest.fixture
def no_cluster() -> None:
    from mpnb.cluster import session as cluster

    assert cluster.current() is None  # these tests plan without a cluster


def _refused(support: dict[str, str | None]) -> set[str]:
    return {s for s, reason in support.items() if reason is not None}


# ----------------------------------------------------------------------------- strategy_support


def test_models_with_transformers_plans_support_every_strategy(models: dict[str, Any]) -> None:
    for family in ("llama", "qwen2"):
        support = strategy_support(models[family], 4)
        assert list(support) == list(STRATEGIES)
        assert _refused(support) == set(), family


def test_gpt2_refuses_tensor_and_pipeline_with_reasons(models: dict[str, Any]) -> None:
    support = strategy_support(models["gpt2"], 4)
    assert _refused(support) == {"tensor", "pipeline"}
    assert support["tensor"] == (f"tensor: GPT2LMHeadModel {NO_TP} and its Conv1D layers cannot be split; "
                                 "use fsdp or zero")
    assert support["pipeline"] == f"pipeline: GPT2LMHeadModel {NO_PP}; use ddp, fsdp or zero"
    # Conv1D cannot be split even by a plan of the user's own
    assert strategy_support(models["gpt2"], 4, tensor_plan={"transformer.h.*.mlp.c_fc": "colwise"})["tensor"]


@pytest.mark.parametrize(("family", "cls"), [("bert-mlm", "BertForMaskedLM"),
                                             ("bert-cls", "BertForSequenceClassification")])
def test_bert_splits_by_mpnb_encoder_plan_but_has_no_pipeline(models: dict[str, Any], family: str,
                                                              cls: str) -> None:
    support = strategy_support(models[family], 4)
    assert support == {"ddp": None, "fsdp": None, "zero": None, "tensor": None,
                       "pipeline": f"pipeline: {cls} {NO_PP}; use ddp, fsdp or zero"}
    assert strategy_support(models[family], 3)["tensor"] == (
        f"tensor: {cls} has 4 attention heads and 4 key/value heads, and no tensor-parallel degree of 3 "
        "ranks (3) divides both; use fsdp or zero")


def test_pipeline_runs_causal_lms_only() -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    support = strategy_support(transformers.LlamaForSequenceClassification(config), 4)
    assert support["pipeline"] == (
        "pipeline: LlamaForSequenceClassification is not a causal LM (mpnb's transformers pipeline runs "
        "*ForCausalLM models); use ddp, fsdp or zero")
    assert support["tensor"] is None


def test_tensor_needs_a_degree_of_the_world_that_divides_the_heads(models: dict[str, Any]) -> None:
    llama = models["llama"]  # 4 heads, 2 key/value heads
    assert strategy_support(llama, 2)["tensor"] is None
    assert strategy_support(llama, 6)["tensor"] is None  # degree 2 of 6 divides both
    reason = strategy_support(llama, 3)["tensor"]
    assert reason == ("tensor: LlamaForCausalLM has 4 attention heads and 2 key/value heads, and no "
                      "tensor-parallel degree of 3 ranks (3) divides both; use fsdp or zero")
    assert strategy_support(llama)["tensor"] is None  # no world: only the model is judged


def test_mpnb_models_keep_every_strategy() -> None:
    assert _refused(strategy_support(tiny_gpt(), 4)) == set()
    assert _refused(strategy_support(mlp(), 4)) == set()
    assert _refused(strategy_support(None, 4)) == _refused(strategy_support(124_000_000, 4)) == set()


def test_a_model_without_known_layers_or_blocks() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Module()
            self.inner.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    support = strategy_support(Odd(), 4)
    assert support["tensor"].startswith("tensor: Odd has no Linear layers mpnb knows how to split")
    assert support["tensor"].endswith("set config.tensor_plan, or use fsdp or zero")
    assert "its repeated blocks 'inner.layers' sit inside another module" in support["pipeline"]
    assert strategy_support(Odd(), 4, tensor_plan={"inner.layers.*": "colwise"})["tensor"] is None


def test_check_config_refuses_strategy_and_head_splits(models: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"^tensor: GPT2LMHeadModel has no tensor-parallel plan.*\.$"):
        check_config(models["gpt2"], Config(strategy="tensor", tensor_parallel=2), 4)
    with pytest.raises(ConfigError, match="tensor_parallel=4 does not divide the 2 key/value heads"):
        check_config(models["llama"], Config(strategy="tensor", tensor_parallel=4), 4)
    check_config(models["llama"], Config(strategy="tensor", tensor_parallel=2), 4)
    with pytest.raises(ConfigError, match="pipeline_stages=8 is more than the 4 layers of LlamaForCausalLM"):
        check_config(models["llama"], Config(strategy="pipeline", pipeline_stages=8, microbatches=8), 8)
    check_config(models["gpt2"], Config(strategy="zero", zero_stage=3), 4)
    assert describe_support(models["llama"], 4) == (
        "LlamaForCausalLM can run under every strategy: ddp, fsdp, zero, pipeline, tensor.")
    assert describe_support(models["bert-cls"]).splitlines() == [
        "BertForSequenceClassification can run under ddp, fsdp, zero, tensor; not under:",
        f"  pipeline: BertForSequenceClassification {NO_PP}; use ddp, fsdp or zero"]


# ----------------------------------------------------------------------------- the panel


def test_panel_fills_the_shape_from_a_transformers_config(models: dict[str, Any], no_cluster: None) -> None:
    panel = mpnb.config_panel(models["llama"], world_size=4, device_kind="cuda", capacity_gb=80)
    try:
        shape = {w.description: (w.value, w.disabled) for w in panel._model_box.children[1:]}
        params = sum(p.numel() for p in models["llama"].parameters())
        assert shape == {"Parameters": (f"{params:,}", True), "Layers": (4, True), "Hidden size": (32, True),
                         "Heads": (4, True), "Key/value heads": (2, True), "Vocabulary": (256, True),
                         "Sequence length": (64, False)}
        assert "Model: LlamaForCausalLM" in panel._model_box.children[0].value
        assert panel.strategy_note.layout.display == "none" and panel.strategy_note.value == ""
        panel.strategy.value = "tensor"
        assert panel.strategy.value == "tensor" and panel.last_estimate is not None
        panel.tensor_parallel.value = 4  # splits the 2 key/value heads: a problem, Apply greyed out
        assert "does not divide the 2 key/value heads" in panel.message.value
        assert panel.apply_button.disabled and panel.last_estimate is None
        assert panel.apply().strategy == "ddp"  # refused: the applied config stays
        panel.tensor_parallel.value = 2
        assert panel.message.value == "" and panel.apply().tensor_parallel == 2
    finally:
        panel.close()


def test_panel_greys_out_what_gpt2_cannot_run(models: dict[str, Any], no_cluster: None) -> None:
    panel = mpnb.config_panel(models["gpt2"], world_size=4, device_kind="cuda", capacity_gb=80)
    try:
        reasons = strategy_support(models["gpt2"], 4)
        assert panel.supported_strategies() == reasons
        classes = set(panel.strategy._dom_classes)
        assert {"mpnb-panel-strategy-off-tensor", "mpnb-panel-strategy-off-pipeline"} <= classes
        assert "mpnb-panel-strategy-off-zero" not in classes
        tips = dict(zip([v for _, v in panel.strategy.options], panel.strategy.tooltips, strict=True))
        assert tips["tensor"] == reasons["tensor"] and tips["pipeline"] == reasons["pipeline"]
        assert tips["zero"] == "DeepSpeed ZeRO stage 0-3"
        note = panel.strategy_note.value  # the visible line under the buttons
        assert panel.strategy_note.layout.display != "none"
        assert "Conv1D layers cannot be split" in note and "has no pipeline plan" in note
        assert "mpnb-panel-strategy-off-tensor" in panel._support_css.value

        panel.strategy.value = "zero"
        panel.strategy.value = "tensor"  # a click on the greyed-out button snaps back, its reason in red
        assert panel.strategy.value == "zero"
        assert "data-strategy='tensor' style='color:#c44e52;font-weight:bold'" in panel.strategy_note.value
        assert panel.message.value == "" and panel.last_estimate is not None
        panel.strategy.value = "fsdp"  # a supported choice clears the highlight
        assert panel.strategy.value == "fsdp" and "color:#c44e52" not in panel.strategy_note.value
    finally:
        panel.close()


def test_a_config_the_model_cannot_run_is_a_problem_not_applied(models: dict[str, Any],
                                                                no_cluster: None) -> None:
    panel = mpnb.config_panel(models["bert-mlm"], world_size=4, device_kind="cuda", capacity_gb=80)
    try:
        panel._set_form(Config(strategy="pipeline", pipeline_stages=2, microbatches=4))  # e.g. the session's
        panel._refresh()
        assert panel.strategy.value == "pipeline"
        assert "pipeline: BertForMaskedLM has no pipeline plan" in panel.message.value
        assert panel.apply_button.disabled
        assert panel.apply().strategy == "ddp" and "has no pipeline plan" in panel.message.value
    finally:
        panel.close()


def test_panel_for_a_model_without_a_config_shows_its_size(no_cluster: None) -> None:
    panel = mpnb.config_panel(mlp(), world_size=2, device_kind="cpu")
    try:
        assert [w.description for w in panel._model_box.children[1:]] == ["Parameters", "Sequence length"]
        assert panel.supported_strategies() == dict.fromkeys(STRATEGIES)
    finally:
        panel.close()


# ----------------------------------------------------------------------------- %mpnb config --model


def test_mpnb_config_names_and_refuses_what_the_model_cannot_run(ipython: Any, models: dict[str, Any],
                                                                 no_cluster: None, capsys) -> None:
    ipython.user_ns["net"] = models["gpt2"]
    ipython.user_ns["n_params"] = 124
    magics = ipython.magics_manager.registry["MpnbMagics"]
    before = magics._config
    try:
        ipython.run_line_magic("mpnb", "config --model net")
        out = capsys.readouterr().out
        assert "GPT2LMHeadModel can run under ddp, fsdp, zero; not under:" in out
        assert "  tensor: GPT2LMHeadModel has no tensor-parallel plan" in out
        with pytest.raises(ConfigError, match=r"^tensor: GPT2LMHeadModel has no tensor-parallel plan"):
            magics.mpnb("config --model net strategy=tensor tensor_parallel=2")
        assert magics._config == before  # nothing was changed
        magics.mpnb("config strategy=zero zero_stage=2 --model net")
        assert magics._config.strategy == "zero" and "zero" in capsys.readouterr().out
        with pytest.raises(ConfigError, match="'nothere' is not defined in the notebook"):
            magics.mpnb("config --model nothere")
        with pytest.raises(ConfigError, match=r"'n_params' is of type int, not a torch model"):
            magics.mpnb("config --model n_params")
    finally:
        magics._config = before
        del ipython.user_ns["net"], ipython.user_ns["n_params"]
