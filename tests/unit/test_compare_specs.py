"""Reading `%%compare`'s configs and options, the comparison's verdict, and the estimator's bytes per step."""

from __future__ import annotations

import pytest

import mpnb
from mpnb.comparison.result import Comparison, ConfigRun
from mpnb.comparison.specs import parse_specs
from mpnb.errors import ConfigError
from mpnb.magics import _split_compare_line
from mpnb.planning.comm_estimate import volume
from mpnb.planning.config import Config


def test_strategies_with_settings_and_short_names():
    base = Config().update(precision="bf16", micro_batch_size=4)
    specs = parse_specs("ddp, zero stage=2, zero3, tensor, pipeline schedule=1f1b, fsdp", base, 2)
    assert [s.label for s in specs] == [
        "ddp", "zero stage=2", "zero3", "tensor", "pipeline schedule=1f1b", "fsdp"]
    zero2, zero3, tensor, pipeline = (s.config for s in specs[1:5])
    assert (zero2.strategy, zero2.zero_stage) == ("zero", 2)
    assert zero3.zero_stage == 3
    assert tensor.tensor_parallel == 2  # a model split with no degree spans the world
    assert (pipeline.pipeline_stages, pipeline.microbatches, pipeline.pipeline_schedule) == (2, 2, "1f1b")
    assert all(s.config.precision == "bf16" and s.config.micro_batch_size == 4 for s in specs)  # kept


def test_dicts_and_configs_are_accepted():
    items = [{"strategy": "zero", "zero_stage": 1}, Config().update(strategy="fsdp")]
    specs = parse_specs(items, Config(), 2)
    assert specs[0].config.zero_stage == 1 and specs[1].config.strategy == "fsdp"
    assert specs[0].label == "zero stage=1"  # labelled as the text form writes it


@pytest.mark.parametrize(("text", "phrase"), [
    ("ddp, zerro", "zerro"),
    ("ddp, tensor tp=4", "cannot run on 2 ranks"),
    ("zero stage=9", "zero stage=9"),
    ("ddp, ddp", "listed twice"),
    ("", "Nothing to compare"),
    ("stage=2", "start each config with its strategy"),
    ("zero stage", "key=value"),
    ("ddp, zero colour=red", "colour"),
])
def test_bad_configs_name_the_problem(text, phrase):
    with pytest.raises(ConfigError) as info:
        parse_specs(text, Config(), 2)
    assert phrase in str(info.value), str(info.value)


def test_magic_line_options():
    assert _split_compare_line("ddp, fsdp --warmup 1 --steps 4 --no-chart") == (
        "ddp, fsdp", {"warmup": 1, "steps": 4, "chart": False})
    assert _split_compare_line("zero stage=2") == ("zero stage=2", {})
    for bad in ("ddp --steps", "ddp --steps x", "ddp --fast"):
        with pytest.raises(ConfigError, match="Usage"):
            _split_compare_line(bad)


def _run(label: str, memory: int, times: list[float], losses: list[float], sent: int) -> ConfigRun:
    ranks = [{"rank": r, "taken": 5, "times": times, "losses": losses, "memory": {"parameters": memory + r},
              "comm": {"all_reduce": {"calls": 1, "bytes": sent, "seconds": 0.0}}, "estimate": None,
              "estimate_comm": {}} for r in range(2)]
    return ConfigRun(label, label, ranks)


def test_verdict_and_losses():
    a = _run("ddp", 1000, [0.010, 0.012, 0.011], [2.0, 1.9, 1.8], 400)
    b = _run("fsdp", 500, [0.020, 0.022, 0.021], [2.0, 1.9, 1.8000001], 600)
    c = _run("zero stage=3", 600, [0.030, 0.03, 0.03], [2.0, 1.5, 1.2], 300)
    failed = ConfigRun("tensor", "tensor", [], error="ValueError on ranks 0,1: no", status="failed")
    result = Comparison([a, b, failed, c], warmup=2, steps=3)
    verdict = result.verdict()
    assert "fastest (all fit: CPU ranks): ddp (11.0 ms/step)" in verdict
    assert "least memory: fsdp" in verdict and "fewest bytes sent: zero stage=3" in verdict
    assert "losses differ from ddp's under: zero stage=3" in verdict
    assert result.losses_match(b) and not result.losses_match(c)
    result.capacity = 800  # on GPUs: ddp (1001 B on its busiest rank) no longer fits
    assert "fastest that fits: fsdp" in result.verdict()
    rows = result.rows()
    assert len(rows) == 7 and rows[4] == {"config": "tensor", "rank": None, "status": "failed",
                                          "error": "ValueError on ranks 0,1: no"}
    assert rows[0]["comm_volume"] == 800  # an all-reduce counts twice in the paper's units
    assert "ValueError on ranks 0,1: no" in result._repr_html_()
    assert len(result.table) == 7


@pytest.mark.parametrize(("config", "paper_units"), [
    ({"strategy": "ddp"}, 2), ({"strategy": "fsdp"}, 3), ({"strategy": "zero", "zero_stage": 0}, 2),
    ({"strategy": "zero", "zero_stage": 2}, 3), ({"strategy": "zero", "zero_stage": 3}, 2),
    ({"strategy": "fsdp", "reshard_after_forward": False}, 2),
])
def test_estimated_bytes_per_step_in_the_papers_units(config, paper_units):
    psi = 10_000_000
    est = mpnb.estimate(psi, config, 4)
    assert volume(est.comm_bytes_per_step) == paper_units * psi * 4
    assert mpnb.estimate(psi, config, 1).comm_bytes_per_step == {}  # one rank sends nothing


def test_estimated_tensor_and_pipeline_bytes_follow_the_activation_shape():
    shape = {"n_layer": 6, "hidden": 512, "n_head": 8, "seq_len": 128, "micro_batch_size": 4}
    tp = mpnb.estimate(50_000_000, {"strategy": "tensor", "tensor_parallel": 2}, 2, **shape)
    assert tp.comm_bytes_per_step == {"all_reduce": 4 * 6 * 4 * 128 * 512 * 4}  # Megatron: 4 per layer
    pipeline = {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 4}
    pp = mpnb.estimate(50_000_000, pipeline, 2, **shape)
    assert pp.comm_bytes_per_step == {"recv": 4 * 128 * 512 * 4, "send": 4 * 128 * 512 * 4}
    pp3 = mpnb.estimate(50_000_000, {**pipeline, "pipeline_stages": 4}, 4, **shape)
    assert pp3.comm_bytes_per_step["send"] == 2 * pp.comm_bytes_per_step["send"]  # middle stages: both ways
