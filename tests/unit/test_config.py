"""mpnb.Config: validation messages, string updates, DeepSpeed round trip, generated code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpnb import Config, ConfigError, MpnbError


def test_defaults_are_valid_everywhere() -> None:
    for world in (1, 2, 4, 8):
        for device in ("cpu", "cuda"):
            assert Config().validate(world, device) == Config()


# (config, world size, device, words the message must contain)
IMPOSSIBLE = [
    (Config(strategy="pipeline", pipeline_stages=3, microbatches=3, micro_batch_size=9), 4, "cuda",
     ["pipeline_stages=3", "does not divide", "4", "1, 2, 4"]),
    (Config(strategy="tensor", tensor_parallel=3), 4, "cuda", ["tensor_parallel=3", "does not divide"]),
    (Config(strategy="tensor", tensor_parallel=8), 4, "cuda", ["tensor_parallel=8", "more than the 4 ranks"]),
    (Config(strategy="pipeline", pipeline_stages=2, zero_stage=3, microbatches=2), 2, "cuda",
     ["ZeRO-3", "pipeline"]),
    (Config(strategy="zero", zero_stage=3, pipeline_stages=2), 2, "cuda", ["ZeRO-3", "pipeline"]),
    (Config(precision="fp16"), 2, "cpu", ["fp16", "CPU", "bf16"]),
    (Config(strategy="pipeline", pipeline_stages=4, microbatches=2), 4, "cuda",
     ["microbatches=2", "fewer than the 4 pipeline stages"]),
    (Config(strategy="pipeline", pipeline_stages=2, microbatches=3, micro_batch_size=8), 2, "cuda",
     ["micro_batch_size=8", "3 equal"]),
    (Config(strategy="ddp", offload="optimizer"), 2, "cuda", ["offload=optimizer", "zero", "fsdp"]),
    (Config(strategy="zero", zero_stage=0, offload="optimizer"), 2, "cuda", ["stage 1, 2 or 3"]),
    (Config(strategy="zero", zero_stage=2, offload="parameters"), 2, "cuda", ["stage 3"]),
    (Config(strategy="fsdp", offload="optimizer"), 2, "cuda", ["CPUOffloadPolicy", "offload=parameters"]),
    (Config(strategy="fsdp", offload="parameters"), 2, "cpu",
     ["offload=parameters", "accelerator", "zero_stage=3"]),
    (Config(strategy="pipeline", pipeline_stages=2, microbatches=2, grad_accum_steps=2), 2, "cuda",
     ["grad_accum_steps=2", "raise microbatches"]),
    (Config(zero_stage=5), 2, "cuda", ["zero_stage must be 0, 1, 2 or 3"]),
    (Config(strategy="ddp", zero_stage=2), 2, "cuda", ["zero_stage=2", "strategy=zero"]),
    (Config(fsdp_wrap=["Block"]), 2, "cuda", ["fsdp_wrap applies only to strategy=fsdp"]),
    (Config(strategy="fdsp"), 2, "cuda", ["strategy must be one of", "'fsdp'"]),
    (Config(precision="fp8"), 2, "cuda", ["precision must be one of", "fp32, bf16, fp16"]),
    (Config(strategy="pipeline", pipeline_stages=2, microbatches=2, pipeline_schedule="zb"), 2, "cuda",
     ["pipeline_schedule must be one of", "gpipe, 1f1b"]),
    (Config(micro_batch_size=0), 2, "cuda", ["micro_batch_size must be a positive integer"]),
    (Config(grad_accum_steps=-1), 2, "cuda", ["grad_accum_steps must be a positive integer"]),
    (Config(strategy="pipeline"), 2, "cuda", ["needs pipeline_stages >= 2"]),
    (Config(strategy="tensor"), 2, "cuda", ["needs tensor_parallel >= 2"]),
    (Config(pipeline_stages=2), 2, "cuda", ["pipeline_stages=2 applies only to strategy=pipeline"]),
    (Config(tensor_parallel=2), 2, "cuda", ["tensor_parallel=2 applies only to strategy=tensor"]),
    (Config(microbatches=4), 2, "cuda", ["microbatches=4 applies only to strategy=pipeline"]),
    (Config(strategy="pipeline", pipeline_stages=2, microbatches=2, pipeline_split_points=["a", "b"]), 2,
     "cuda", ["2 pipeline stages need 1 split points"]),
    (Config(tensor_plan={"mlp.fc": "colwise"}), 2, "cuda", ["tensor_plan applies only to strategy=tensor"]),
    (Config(tensor_plan={"mlp.fc": "diagonal"}, strategy="tensor", tensor_parallel=2), 2, "cuda",
     ["colwise, rowwise"]),
    (Config(), 0, "cuda", ["world_size must be a positive integer"]),
    (Config(strategy="pipeline", pipeline_stages=2, microbatches=2), 1, "cuda", ["needs at least 2"]),
    (Config(strategy="tensor"), 1, "cuda", ["needs at least 2", "use ddp"]),
    (Config(), 2, "tpu", ["device_kind must be one of cpu, cuda"]),
]


@pytest.mark.parametrize(("cfg", "world", "device", "words"), IMPOSSIBLE)
def test_each_impossible_combination_has_a_clear_message(cfg: Config, world: int, device: str,
                                                         words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        cfg.validate(world, device)
    assert isinstance(info.value, MpnbError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_possible_compositions_pass() -> None:
    Config(strategy="fsdp", offload="parameters").validate(2, "cuda")  # CPUOffloadPolicy on an accelerator
    Config(strategy="zero", zero_stage=3, offload="parameters").validate(2, "cpu")  # the CPU alternative
    Config(strategy="tensor", tensor_parallel=2).validate(4, "cpu")  # TP 2 x FSDP 2
    Config(strategy="pipeline", pipeline_stages=2, microbatches=4,
           pipeline_schedule="1f1b").validate(4, "cpu")
    Config(strategy="zero", zero_stage=3, offload="parameters", precision="bf16").validate(2, "cpu")
    Config(strategy="fsdp", offload="parameters", precision="fp16").validate(2, "cuda")
    Config(strategy="fsdp", fsdp_wrap=["Block"], reshard_after_forward=False).validate(2, "cpu")


def test_fp16_allowed_when_device_unknown_but_not_on_cpu() -> None:
    cfg = Config(precision="fp16")
    assert cfg.problems(2, None) == []
    assert cfg.problems(2, "cuda") == []
    assert len(cfg.problems(2, "cpu")) == 1


def test_update_from_strings_coerces_types() -> None:
    base = Config()
    cfg = base.update_from_strings(["zero_stage=3", "strategy=ZeRO", "activation_checkpointing=yes",
                                    "micro_batch_size = 4", "precision=bfloat16", "fsdp_wrap=Block,MLP",
                                    "tensor_plan=mlp.fc:colwise,mlp.proj:rowwise"])
    assert cfg is not base and base == Config()  # a new Config, the old one untouched
    assert cfg.zero_stage == 3 and cfg.strategy == "zero"
    assert cfg.activation_checkpointing is True
    assert cfg.micro_batch_size == 4
    assert cfg.precision == "bf16"
    assert cfg.fsdp_wrap == ["Block", "MLP"]
    assert cfg.tensor_plan == {"mlp.fc": "colwise", "mlp.proj": "rowwise"}
    assert cfg.update_from_strings(["fsdp_wrap=['Block']"]).fsdp_wrap == ["Block"]


def test_unknown_key_suggests_the_closest_name() -> None:
    with pytest.raises(ConfigError, match="Did you mean `zero_stage`"):
        Config().update_from_strings(["zero_stag=3"])
    with pytest.raises(ConfigError, match="Did you mean `micro_batch_size`"):
        Config().update(microbatch_size=4)
    with pytest.raises(ConfigError, match="Known settings"):
        Config().update(qwertyuiop=1)


def test_bad_values_name_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="strategy must be one of ddp, fsdp, zero, pipeline, tensor"):
        Config().update(strategy="megatron")
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1, 2 or 3"):
        Config().update_from_strings(["zero_stage=4"])
    with pytest.raises(ConfigError, match="zero_stage must be an integer"):
        Config().update_from_strings(["zero_stage=two"])
    with pytest.raises(ConfigError, match="true or false"):
        Config().update(activation_checkpointing="maybe")
    with pytest.raises(ConfigError, match="key=value"):
        Config().update_from_strings(["zero_stage"])
    with pytest.raises(ConfigError, match="positive integer"):
        Config().update(tensor_parallel=0)


def test_derived_sizes_and_summary() -> None:
    assert Config(micro_batch_size=8, grad_accum_steps=2).global_batch_size(4) == 64
    tp = Config(strategy="tensor", tensor_parallel=2, micro_batch_size=4)
    assert tp.data_parallel(8) == 4 and tp.global_batch_size(8) == 16
    pp = Config(strategy="pipeline", pipeline_stages=4, microbatches=4)
    assert pp.data_parallel(4) == 1
    times = "\u00d7"
    assert Config(strategy="zero", zero_stage=2).summary() == f"ZeRO-2 · fp32 · mb 8 {times} accum 1"
    assert Config(strategy="fsdp", precision="bf16", activation_checkpointing=True).summary() == (
        f"FSDP · bf16 · mb 8 {times} accum 1 · checkpointing")
    assert f"TP 2 {times} FSDP 2" in tp.summary(4)
    assert "\n" not in pp.summary(4)


def test_changing_strategy_resets_what_belonged_to_the_old_one() -> None:
    zero = Config().update(strategy="zero", zero_stage=3, offload="parameters")
    ddp = zero.update_from_strings(["strategy=ddp"])
    assert (ddp.zero_stage, ddp.offload) == (0, "none")
    ddp.validate(2, "cpu")
    pipe = Config().update(strategy="pipeline", pipeline_stages=2, microbatches=4)
    tensor = pipe.update(strategy="tensor", tensor_parallel=2)
    assert (tensor.pipeline_stages, tensor.microbatches, tensor.tensor_parallel) == (1, 1, 2)
    tensor.validate(2, "cpu")
    # settings given in the same update win, so a contradiction still reaches validate
    bad = zero.update(strategy="ddp", zero_stage=2)
    assert bad.zero_stage == 2 and bad.problems(2, "cpu")
    # no strategy change: nothing is reset
    assert zero.update(precision="bf16").zero_stage == 3


def test_diff_lists_changed_fields() -> None:
    a = Config()
    b = a.update(strategy="zero", zero_stage=2)
    assert a.diff(b) == {"strategy": ("ddp", "zero"), "zero_stage": (0, 2)}


def test_to_deepspeed_sections() -> None:
    cfg = Config(strategy="zero", zero_stage=3, offload="parameters", precision="bf16", micro_batch_size=4,
                 grad_accum_steps=2)
    ds = cfg.to_deepspeed(4)
    assert ds["train_batch_size"] == 32
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    assert ds["zero_allow_untested_optimizer"] is True
    json.dumps(ds)  # must be writable as ds_config.json
    assert Config(strategy="fsdp").to_deepspeed(2)["zero_optimization"]["stage"] == 3
    assert Config(strategy="ddp").to_deepspeed(2)["zero_optimization"] == {"stage": 0}
    with pytest.raises(ConfigError, match="no ds_config"):
        Config(strategy="tensor", tensor_parallel=2).to_deepspeed(2)
    with pytest.raises(ConfigError, match="does not divide"):
        Config(strategy="tensor", tensor_parallel=3).to_deepspeed(4)


@pytest.mark.parametrize("cfg", [
    Config(strategy="zero"),
    Config(strategy="zero", zero_stage=1, precision="bf16", micro_batch_size=2, grad_accum_steps=4),
    Config(strategy="zero", zero_stage=2, offload="optimizer", precision="fp16"),
    Config(strategy="zero", zero_stage=3, offload="parameters", activation_checkpointing=True),
])
def test_deepspeed_round_trip(cfg: Config) -> None:
    ds = cfg.to_deepspeed(4)
    assert Config.from_deepspeed(ds, world_size=4) == cfg
    assert Config.from_deepspeed(json.dumps(ds)) == cfg


def test_from_deepspeed_reads_foreign_configs() -> None:
    cfg = Config.from_deepspeed({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
                                 "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW"}}, world_size=4)
    assert (cfg.zero_stage, cfg.grad_accum_steps, cfg.offload, cfg.precision) == (2, 2, "none", "fp32")
    with pytest.raises(ConfigError, match="train_batch_size=10 does not equal"):
        Config.from_deepspeed({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 1}, world_size=2)
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1, 2 or 3"):
        Config.from_deepspeed({"zero_optimization": {"stage": 7}})
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_deepspeed("{stage: 2")


def test_deepspeed_accepts_the_generated_config() -> None:
    """DeepSpeed's own config parser reads what to_deepspeed writes (no process group needed)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = Config(strategy="zero", zero_stage=2, precision="bf16", micro_batch_size=4, grad_accum_steps=2,
                offload="optimizer").to_deepspeed(1)
    parsed = DeepSpeedConfig(ds)  # no process group: world size 1; it checks batch = mb * gas * world itself
    assert parsed.zero_optimization_stage == 2
    assert parsed.train_batch_size == 8
    assert parsed.bfloat16_config.enabled is True and not parsed.float16_config.enabled
    assert parsed.zero_config.offload_optimizer.device == "cpu"


STRATEGY_APIS = [
    (Config(), ["DistributedDataParallel", "DDP(model"]),
    (Config(strategy="fsdp", precision="bf16"), ["fully_shard", "MixedPrecisionPolicy", "torch.bfloat16",
                                                 "init_device_mesh"]),
    (Config(strategy="fsdp", offload="parameters"), ["CPUOffloadPolicy"]),
    (Config(strategy="zero", zero_stage=2), ["deepspeed.initialize", "'stage': 2", "engine.backward"]),
    (Config(strategy="pipeline", pipeline_stages=2, microbatches=4, pipeline_schedule="1f1b"),
     ["PipelineStage", "Schedule1F1B", "n_microbatches=4", "(2, 2)", 'mesh_dim_names=("pp", "dp")',
      'fully_shard(block, mesh=mesh["dp"]']),
    (Config(strategy="pipeline", pipeline_stages=4, microbatches=4), ["ScheduleGPipe", "(4, 1)"]),
    (Config(strategy="tensor", tensor_parallel=2),
     ["parallelize_module", "ColwiseParallel", "RowwiseParallel", "'blocks.*.mlp.fc'",
      'mesh_dim_names=("dp", "tp")',
      "fully_shard"]),
    (Config(strategy="tensor", tensor_parallel=4, tensor_plan={"fc1": "colwise", "fc2": "rowwise"}),
     ["'fc1': ColwiseParallel()", "'fc2': RowwiseParallel()"]),
    (Config(activation_checkpointing=True), ["from torch.distributed._composable import checkpoint"]),
]


@pytest.mark.parametrize(("cfg", "apis"), STRATEGY_APIS)
def test_to_code_compiles_and_uses_the_strategy_apis(cfg: Config, apis: list[str]) -> None:
    code = cfg.to_code(4, "cpu")
    compile(code, f"<{cfg.strategy}>", "exec")
    for api in apis:
        assert api in code, (api, code)
    assert '"gloo"' in code and '"nccl"' in cfg.to_code(4, "cuda")


def test_to_code_without_dp_skips_fsdp_for_pure_tensor_parallel() -> None:
    code = Config(strategy="tensor", tensor_parallel=4).to_code(4, "cpu")
    assert "fully_shard" not in code and "parallelize_module" in code
    pipeline_only = Config(strategy="pipeline", pipeline_stages=2, microbatches=2).to_code(2, "cpu")
    assert "fully_shard" not in pipeline_only


def test_to_code_shards_pipeline_stages_with_fsdp_not_ddp() -> None:
    # DDP around a PipelineStage miscounts gradients with several microbatches; the engine uses FSDP2
    code = Config(strategy="pipeline", pipeline_stages=2, microbatches=4).to_code(4, "cpu")
    assert "DistributedDataParallel" not in code and "DDP(" not in code
    assert code.index("fully_shard(model") < code.index("PipelineStage(model")


def test_config_module_does_not_import_torch() -> None:
    code = ("import sys, mpnb; from mpnb import Config; c = Config(strategy='zero', zero_stage=2);"
            "c.validate(2, 'cpu'); c.to_deepspeed(2); c.to_code(2); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------------- malformed input (issue 14 item 8)

_DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
_MB = "train_micro_batch_size_per_gpu"


@pytest.mark.parametrize(("ds", "named"), [
    ({_MB: 0, "train_batch_size": 32}, _MB),
    ({_MB: "abc", "train_batch_size": 32}, _MB),
    ({_MB: float("nan"), "train_batch_size": 32}, _MB),
    ({_MB: float("inf"), "train_batch_size": 32}, _MB),
    ({_MB: [8], "train_batch_size": 32}, _MB),
    ({_MB: True}, _MB),
    ({_MB: -4}, _MB),
    ({_MB: 2.5}, _MB),
    ({_MB: 10**40}, _MB),
    ({"gradient_accumulation_steps": 0, "train_batch_size": 32}, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": "x", "train_batch_size": 32}, "gradient_accumulation_steps"),
    ({"train_batch_size": "abc", _MB: 4}, "train_batch_size"),
    ({"train_batch_size": 0, _MB: 4}, "train_batch_size"),
    ({"train_batch_size": [32], "gradient_accumulation_steps": 1}, "train_batch_size"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": [2]}}, "zero_optimization.stage"),
    ('{"train_micro_batch_size_per_gpu": NaN, "train_batch_size": 32}', _MB),
    ('{"train_micro_batch_size_per_gpu": Infinity}', _MB),
    ('{"train_batch_size": 1e400, "train_micro_batch_size_per_gpu": 4}', "train_batch_size"),  # OverflowError
    (_DEEP, "nested too deeply"),
    ('{"train_batch_size": ' + "9" * 5000 + "}", "not valid JSON"),  # past Python's int-digits limit
    (" " * 2_000_000, "characters long"),
])
def test_from_deepspeed_names_the_key_of_every_malformed_value(ds: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Config.from_deepspeed(ds, world_size=2)


def test_from_deepspeed_refuses_a_bad_world_size() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        Config.from_deepspeed({"train_batch_size": 8}, world_size=0)


def test_numbers_written_as_text_or_floats_are_numbers() -> None:
    cfg = Config(micro_batch_size="8", grad_accum_steps=2.0, zero_stage="2", strategy="zero")
    assert (cfg.micro_batch_size, cfg.grad_accum_steps, cfg.zero_stage) == (8, 2, 2)
    assert cfg == Config(micro_batch_size=8, grad_accum_steps=2, zero_stage=2, strategy="zero")
    ds = Config(micro_batch_size="8").to_deepspeed(2)
    assert ds["train_batch_size"] == 16 and type(ds["train_batch_size"]) is int  # not "88"
    assert type(ds["train_micro_batch_size_per_gpu"]) is int
    assert Config().update_from_strings(["micro_batch_size=1e3"]).micro_batch_size == 1000
    assert Config(reshard_after_forward="false").reshard_after_forward is False  # not a truthy string
    assert Config(fsdp_wrap="Block,MLP").fsdp_wrap == ["Block", "MLP"]  # not the letters of a string


@pytest.mark.parametrize(("field", "value"), [
    ("micro_batch_size", "abc"), ("micro_batch_size", float("nan")), ("micro_batch_size", float("inf")),
    ("micro_batch_size", 0), ("micro_batch_size", -1), ("micro_batch_size", True), ("micro_batch_size", [8]),
    ("micro_batch_size", 2.5), ("micro_batch_size", 10**12), ("grad_accum_steps", None),
    ("pipeline_stages", "many"), ("microbatches", 0), ("tensor_parallel", {}), ("zero_stage", -1),
    ("zero_stage", 1.5), ("reshard_after_forward", "maybe"), ("activation_checkpointing", 2),
    ("fsdp_wrap", 5), ("fsdp_wrap", [1, 2]), ("pipeline_split_points", {"a": 1}),
    ("tensor_plan", ["mlp.fc"]), ("tensor_plan", {"mlp.fc": 3}), ("tensor_plan", {"": "colwise"}),
    ("precision", ["bf16"]), ("offload", 3.5), ("pipeline_schedule", None), ("strategy", 7),
])
def test_every_field_is_checked_for_type_and_range(field: str, value: object) -> None:
    cfg = Config(**{field: value})  # construction stays cheap and lenient
    problems = cfg.problems(2)
    assert problems and field in problems[0], problems
    for call in (lambda: cfg.validate(2), lambda: cfg.to_deepspeed(2), lambda: cfg.to_code(2),
                 lambda: Config().update(**{field: value})):
        with pytest.raises(ConfigError, match=field):
            call()


def test_a_field_assigned_after_construction_is_checked() -> None:
    cfg = Config()
    cfg.micro_batch_size = "8"  # dataclass fields can be set directly; validation still sees the type
    with pytest.raises(ConfigError, match="micro_batch_size='8' is not written as mpnb expects; use 8"):
        cfg.to_deepspeed(2)


def test_malformed_literals_in_strings_are_config_errors() -> None:
    for item in ["fsdp_wrap=" + "[" * 500, "fsdp_wrap=[" + "1" * 5000 + "]", "tensor_plan={" * 300,
                 "tensor_plan={{}: 1}"]:
        with pytest.raises(ConfigError, match=item.partition("=")[0]):
            Config().update_from_strings([item])


def test_construction_stays_cheap() -> None:
    import timeit

    per_call = min(timeit.repeat(Config, number=2000, repeat=3)) / 2000
    assert per_call < 100e-6, f"Config() takes {per_call * 1e6:.1f} µs"
