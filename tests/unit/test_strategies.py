"""Strategy checks in this process, without a process group: pipeline splits, tensor plans, bad config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.engine.strategies.pipeline import split_model
from mpnb.engine.strategies.tensor import check_plan, default_plan
from mpnb.errors import MpnbError
from mpnb.models import tiny_gpt


def test_split_points_must_name_blocks():
    with pytest.raises(MpnbError, match=r"'blocks\.9' is not a block of GPT.*blocks\.0"):
        split_model(tiny_gpt(0), 2, 0, ["blocks.9"])
    with pytest.raises(MpnbError, match="fewer than pipeline_stages=8"):
        split_model(tiny_gpt(0), 8, 0, [])


def test_split_keeps_names_and_drops_other_stages():
    last = split_model(tiny_gpt(0), 2, 1, ["blocks.1"])
    names = [n for n, _ in last.named_parameters()]
    assert names[0].startswith("blocks.1.") and "head.weight" in names
    assert not any(n.startswith(("tok_emb", "blocks.0.")) for n in names)
    seq = split_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), 2, 1, ["2"])
    assert [n for n, _ in seq.named_parameters()] == ["2.weight", "2.bias"]


def test_default_plan_and_plan_checks():
    plan = default_plan(tiny_gpt(0))
    assert plan["blocks.0.attn.qkv"] == "colwise" and plan["blocks.3.mlp.proj"] == "rowwise"
    with pytest.raises(MpnbError, match="does not divide"):
        check_plan(tiny_gpt(0), {"blocks.0.mlp.fc": "colwise"}, 3)
    with pytest.raises(MpnbError, match="LayerNorm"):
        check_plan(tiny_gpt(0), {"blocks.0.ln_1": "colwise"}, 2)
    with pytest.raises(MpnbError, match="No tensor-parallel plan"):
        check_plan(nn.Conv1d(2, 2, 1), default_plan(nn.Conv1d(2, 2, 1)), 2)


def test_prepare_rejects_bad_config_before_engine_work():
    from mpnb.errors import ConfigError

    with pytest.raises(ConfigError, match="zero_stag"):
        from mpnb.engine.prepare import prepare

        prepare(tiny_gpt(0), config={"zero_stag": 2})
    assert torch.distributed.is_initialized() is False


def test_sharding_strategies_need_a_process_group():
    from mpnb.engine.prepare import prepare

    with pytest.raises(MpnbError, match="strategy=fsdp needs a process group"):
        prepare(tiny_gpt(0), config={"strategy": "fsdp"})
