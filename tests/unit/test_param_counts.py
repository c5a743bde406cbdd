"""`Trainer.parameter_counts()`: the whole model's count and this rank's part, whatever holds the parameters.

Real ZeRO-3, FSDP2, tensor and pipeline runs are checked in tests/cluster/test_strategies.py; here the
parameter kinds are built by hand.
"""

from __future__ import annotations

import torch
from torch import nn

from mpnb.engine import param_counts
from mpnb.engine.param_counts import count_parameters, held_as


def _zero3_param(numel: int, partition: int) -> nn.Parameter:
    """A parameter as DeepSpeed ZeRO-3 leaves it: empty data, the rank's padded partition in ds_tensor."""
    p = nn.Parameter(torch.empty(0))
    p.ds_numel = numel
    p.ds_tensor = torch.empty(partition)
    p.ds_tensor.ds_numel = partition
    return p


def test_plain_parameters_are_all_held() -> None:
    model = nn.Linear(10, 4)
    counts = count_parameters(model.parameters())
    assert (counts.total, counts.local) == (44, 44)
    assert str(counts) == "44 parameters, all held on this rank"


def test_shared_parameters_count_once() -> None:
    a = nn.Linear(3, 3, bias=False)
    assert count_parameters([a.weight, a.weight]).total == 9


def test_zero3_partitions_count_real_elements_not_padding(monkeypatch) -> None:
    params = [_zero3_param(9, 5), _zero3_param(4, 2)]  # 9 elements on 2 ranks: 5 + 4 (+1 padding)
    assert sum(p.numel() for p in params) == 0  # what model.num_parameters() sees
    monkeypatch.setattr(param_counts.dist, "is_initialized", lambda: True)
    held = []
    for rank in (0, 1):
        monkeypatch.setattr(param_counts.dist, "get_rank", lambda group=None, r=rank: r)
        counts = count_parameters(params, held_as=held_as("zero", 3, 2))
        assert counts.total == 13
        held.append(counts.local)
    assert held == [7, 6] and sum(held) == 13
    assert str(counts) == "13 parameters, 6 held on this rank (its ZeRO-3 partition)"


def test_given_total_for_a_pipeline_stage() -> None:
    stage = nn.Linear(5, 5)
    counts = count_parameters(stage.parameters(), total=100, held_as=held_as("pipeline", 0, 1, 1))
    assert (counts.total, counts.local) == (100, 30)
    assert str(counts).endswith("30 held on this rank (pipeline stage 1)")
