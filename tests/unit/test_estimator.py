"""mpnb.estimate against the ZeRO paper, DeepSpeed's own estimators, Korthikanti et al. and real tensors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpnb import Config, ConfigError, estimate
from mpnb.planning.estimator import MODEL_STATE_BYTES
from mpnb.units import format_bytes

PSI = 7_500_000_000  # the ZeRO paper's Figure 1: 7.5B parameters, 64 GPUs, K = 12


@pytest.mark.parametrize(("cfg", "expected"), [
    (Config(strategy="ddp"), "120.0 GB"),
    (Config(strategy="zero", zero_stage=1), "31.4 GB"),
    (Config(strategy="zero", zero_stage=2), "16.6 GB"),
    (Config(strategy="zero", zero_stage=3), "1.9 GB"),
    (Config(strategy="fsdp"), "1.9 GB"),
])
def test_zero_paper_figure_1(cfg: Config, expected: str) -> None:
    est = estimate(PSI, cfg, 64, accounting="paper")
    assert f"{est.model_states / 1e9:.1f} GB" == expected  # the paper writes decimal GB
    # the same figure from DeepSpeed in mixed precision, where the implementation keeps 2 + 2 + 12
    if cfg.strategy == "zero":
        bf16 = estimate(PSI, cfg.update(precision="bf16"), 64)
        assert bf16.model_states == est.model_states
        assert bf16.bytes_per_param == (2.0, 2.0, 12.0)


def test_paper_formula_exactly() -> None:
    n = 64
    base = estimate(PSI, Config(), n, accounting="paper")
    z1 = estimate(PSI, Config(strategy="zero", zero_stage=1), n, accounting="paper")
    z2 = estimate(PSI, Config(strategy="zero", zero_stage=2), n, accounting="paper")
    z3 = estimate(PSI, Config(strategy="zero", zero_stage=3), n, accounting="paper")
    assert base.model_states == 16 * PSI
    assert z1.model_states == pytest.approx(4 * PSI + 12 * PSI / n, abs=2)
    assert z2.model_states == pytest.approx(2 * PSI + 14 * PSI / n, abs=2)
    assert z3.model_states == pytest.approx(16 * PSI / n, abs=2)
    assert (z1.parameters, z1.gradients) == (2 * PSI, 2 * PSI)
    assert z2.gradients == pytest.approx(2 * PSI / n, abs=1)


@pytest.mark.parametrize("num_params", [1_000_000, 125_000_000, 7_000_000_000, 70_000_000_000])
@pytest.mark.parametrize(("gpus_per_node", "nodes"), [(1, 1), (2, 1), (8, 1), (8, 4)])
@pytest.mark.parametrize("offload", [False, True])
def test_agrees_with_deepspeed_zero2_estimator(num_params: int, gpus_per_node: int, nodes: int,
                                               offload: bool) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(num_params, gpus_per_node, nodes, cpu_offload=offload,
                                                   additional_buffer_factor=1.5)
    cfg = Config(strategy="zero", zero_stage=2, precision="bf16", offload="optimizer" if offload else "none")
    est = estimate(num_params, cfg, gpus_per_node * nodes, accounting="deepspeed")
    assert est.model_states + est.buffers == pytest.approx(gpu, abs=2)


@pytest.mark.parametrize("num_params", [1_000_000, 125_000_000, 7_000_000_000])
@pytest.mark.parametrize(("gpus_per_node", "nodes"), [(1, 1), (4, 1), (8, 2)])
@pytest.mark.parametrize("offload", ["none", "optimizer", "parameters"])
def test_agrees_with_deepspeed_zero3_estimator(num_params: int, gpus_per_node: int, nodes: int,
                                               offload: str) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    largest = num_params // 20
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        num_params, largest, gpus_per_node, nodes, cpu_offload=offload != "none",
        cpu_offload_params=offload == "parameters", zero_init=True, additional_buffer_factor=1.5)
    cfg = Config(strategy="zero", zero_stage=3, precision="bf16", offload=offload)
    est = estimate(num_params, cfg, gpus_per_node * nodes, accounting="deepspeed",
                   largest_layer_params=largest)
    assert est.model_states + est.buffers == pytest.approx(gpu, abs=2)
    if offload != "none":
        assert est.offloaded > 0


def test_module_counts_match_deepspeed_model_to_params() -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params

    from mpnb.models import tiny_gpt

    model = tiny_gpt()
    total, largest = model_to_params(model)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, 2, 1, cpu_offload=False)
    est = estimate(model, Config(strategy="zero", zero_stage=3, precision="bf16"), 2, accounting="deepspeed")
    assert est.num_params == total == model.num_parameters()
    assert est.model_states + est.buffers == pytest.approx(gpu, abs=2)


def test_implementation_table_follows_the_strategies() -> None:
    n = 1_000_000
    assert estimate(n, Config(), 2).bytes_per_param == (4.0, 4.0, 8.0)  # fp32 AdamW under DDP
    assert estimate(n, Config(precision="bf16"), 2).bytes_per_param == (4.0, 4.0, 8.0)  # autocast
    assert estimate(n, Config(strategy="fsdp", precision="bf16"), 2).bytes_per_param == (4.0, 4.0, 8.0)
    assert estimate(n, Config(strategy="zero", zero_stage=2), 2).bytes_per_param == (4.0, 4.0, 12.0)
    assert estimate(n, Config(strategy="zero"), 2).bytes_per_param == (4.0, 4.0, 8.0)
    assert estimate(n, Config(), 2, optimizer="sgd").bytes_per_param == (4.0, 4.0, 0.0)
    assert estimate(n, Config(), 2, optimizer="sgd_momentum").optimizer == 4 * n
    assert set(MODEL_STATE_BYTES) >= {("torch", p) for p in ("fp32", "bf16", "fp16")}
    ddp = estimate(n, Config(), 4)
    fsdp = estimate(n, Config(strategy="fsdp"), 4)
    assert (ddp.parameters, ddp.gradients, ddp.optimizer) == (4 * n, 4 * n, 8 * n)
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer) == (n, n, 2 * n)


def test_deepspeed_reduce_bucket_is_a_buffer() -> None:
    # mpnb caps DeepSpeed's 5e8-element bucket at the model's size: the fp32 bucket holds every gradient
    capped = estimate(1_000_000, Config(strategy="zero", zero_stage=2), 2)
    assert capped.buffers == 1_000_000 * 4 and not any("reduce_bucket_size" in n for n in capped.notes)
    assert estimate(10**9, Config(strategy="zero", zero_stage=2), 2).buffers == 500_000_000 * 4
    small = estimate(1_000_000, Config(strategy="zero", zero_stage=2), 2, reduce_bucket_size=500_000_000)
    assert small.buffers == 500_000_000 * 4  # allocated whole by DeepSpeed
    assert any("reduce_bucket_size" in n for n in small.notes)
    tuned = estimate(1_000_000, Config(strategy="zero", zero_stage=2, precision="bf16"), 2,
                     reduce_bucket_size=1_000_000)
    assert tuned.buffers == 2 * 1_000_000 and not any("reduce_bucket_size" in n for n in tuned.notes)
    # model states are unaffected by the bucket
    assert small.model_states == estimate(1_000_000, Config(strategy="zero", zero_stage=2), 2,
                                          reduce_bucket_size=1).model_states


def test_gather_buffers_need_the_layer_size() -> None:
    bucket = 500_000_000 * 4  # ZeRO-3 allocates its fp32 reduce bucket at initialize and keeps it
    bare = estimate(10**8, Config(strategy="zero", zero_stage=3), 4, reduce_bucket_size=500_000_000)
    assert bare.buffers == bucket and any("largest_layer_params" in n for n in bare.notes)
    given = estimate(10**8, Config(strategy="zero", zero_stage=3), 4, largest_layer_params=10**6,
                     reduce_bucket_size=10**6)
    assert given.buffers == 4 * 10**6 + 4 * 10**6 and not given.notes[1:]
    shaped = estimate(10**8, Config(strategy="fsdp"), 4, n_layer=8, hidden=512)
    block = 12 * 512 * 512 + 13 * 512
    assert shaped.buffers == 2 * block * 4 + 4 * block  # current + prefetched block, one fp32 gradient
    assert not any("largest_layer_params" in n for n in shaped.notes)


def test_offload_moves_states_to_cpu() -> None:
    n = 10_000_000
    on = estimate(n, Config(strategy="zero", zero_stage=2), 4)
    off = estimate(n, Config(strategy="zero", zero_stage=2, offload="optimizer"), 4)
    assert off.optimizer == 0 and off.gradients == 0
    assert off.offloaded == on.optimizer + on.gradients
    assert off.parameters == on.parameters
    z3 = estimate(n, Config(strategy="zero", zero_stage=3, offload="parameters"), 4)
    assert z3.model_states == 0 and z3.offloaded > 0
    fsdp = estimate(n, Config(strategy="fsdp", offload="parameters"), 4)
    assert fsdp.model_states == 0 and fsdp.offloaded == 16 * n // 4


def _korthikanti(L: int, s: int, b: int, h: int, a: int, t: int = 1) -> float:
    """Eq. 1 and 2 of Korthikanti et al. 2022 (16-bit, dropout, standard attention)."""
    return L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


SHAPE = dict(n_layer=24, hidden=2048, n_head=16, seq_len=2048)


def test_activations_follow_korthikanti() -> None:
    L, h, a, s, b = 24, 2048, 16, 2048, 4
    n = 1_300_000_000
    cfg = Config(precision="bf16", micro_batch_size=b)
    est = estimate(n, cfg, 1, **SHAPE)
    assert est.activations == pytest.approx(L * s * b * h * (34 + 5 * a * s / h), rel=1e-9)
    tp = estimate(n, Config(strategy="tensor", tensor_parallel=4, precision="bf16", micro_batch_size=b), 4,
                  **SHAPE)
    assert tp.activations == pytest.approx(_korthikanti(L, s, b, h, a, t=4), rel=1e-9)
    fp32 = estimate(n, Config(micro_batch_size=b), 1, **SHAPE)
    assert fp32.activations == pytest.approx(L * s * b * h * (66 + 9 * a * s / h), rel=1e-9)
    flash = estimate(n, cfg, 1, flash_attention=True, dropout=False, **SHAPE)
    assert flash.activations == pytest.approx(L * s * b * h * 32, rel=1e-9)


def test_checkpointing_keeps_layer_inputs() -> None:
    L, h, a, s, b = 24, 2048, 16, 2048, 4
    cfg = Config(precision="bf16", micro_batch_size=b, activation_checkpointing=True)
    est = estimate(1_300_000_000, cfg, 1, **SHAPE)
    one_layer = s * b * h * (34 + 5 * a * s / h)
    assert est.activations == pytest.approx(2 * s * b * h * L + one_layer, rel=1e-9)
    full = estimate(1_300_000_000, cfg.update(activation_checkpointing=False), 1, **SHAPE)
    assert est.activations < full.activations / 5


def test_pipeline_splits_layers_and_keeps_microbatches_in_flight() -> None:
    L, h, a, s = 24, 2048, 16, 2048
    m, pp, mb = 8, 4, 16
    per_layer = s * (mb // m) * h * (34 + 5 * a * s / h)
    gpipe = estimate(1_300_000_000, Config(strategy="pipeline", pipeline_stages=pp, microbatches=m,
                                           micro_batch_size=mb, precision="bf16"), pp, **SHAPE)
    one_f = estimate(1_300_000_000, Config(strategy="pipeline", pipeline_stages=pp, microbatches=m,
                                           pipeline_schedule="1f1b", micro_batch_size=mb, precision="bf16"),
                     pp, **SHAPE)
    assert gpipe.ranks[0].activations == pytest.approx(L / pp * per_layer * m, rel=1e-9)
    assert one_f.ranks[0].activations == pytest.approx(L / pp * per_layer * pp, rel=1e-9)
    assert one_f.ranks[pp - 1].activations == pytest.approx(L / pp * per_layer * 1, rel=1e-9)
    # parameters are split across stages: together they hold the model once
    assert sum(r.parameters for r in gpipe.ranks) == pytest.approx(4 * 1_300_000_000, abs=8)


def test_pipeline_times_data_shards_each_stage_over_its_data_parallel_ranks() -> None:
    # 4 ranks, 2 stages: the engine's (pp, dp) mesh puts stage s on ranks [2s, 2s + 2), FSDP2 over dp=2
    from mpnb.models import tiny_gpt

    model = tiny_gpt(n_layer=4)
    cfg = Config(strategy="pipeline", pipeline_stages=2, microbatches=2)
    alone = estimate(model, cfg, 2)
    with_dp = estimate(model, cfg, 4)
    for rank, stage in enumerate((0, 0, 1, 1)):
        mine, whole = with_dp.ranks[rank], alone.ranks[stage]
        assert mine.parameters == whole.parameters // 2
        assert mine.gradients == whole.gradients // 2
        assert mine.optimizer == whole.optimizer // 2
        assert mine.buffers > 0  # FSDP2's gathered units
    assert with_dp.ranks[0].activations == with_dp.ranks[1].activations != with_dp.ranks[2].activations


def test_tiny_gpt_shape_is_read_from_the_module() -> None:
    from mpnb.models import GPTConfig, tiny_gpt

    model = tiny_gpt()
    c = GPTConfig()
    est = estimate(model, Config(), 1)
    by_hand = estimate(model.num_parameters(), Config(), 1, n_layer=c.n_layer, hidden=c.n_embd,
                       n_head=c.n_head, seq_len=c.seq_len, vocab_size=c.vocab_size, flash_attention=True,
                       dropout=False)
    assert est.activations == by_hand.activations > 0
    assert est.num_params == model.num_parameters()


def test_tiny_gpt_splits_by_pipeline_stage_and_tensor_plan() -> None:
    from mpnb.models import tiny_gpt

    model = tiny_gpt(n_layer=4)
    n = model.num_parameters()
    first = sum(p.numel() for p in (*model.tok_emb.parameters(), *model.pos_emb.parameters()))
    last = sum(p.numel() for p in (*model.ln_f.parameters(), *model.head.parameters()))
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    pipe = estimate(model, Config(strategy="pipeline", pipeline_stages=2, microbatches=2), 2)
    assert pipe.ranks[0].parameters == 4 * (first + blocks[0] + blocks[1])
    assert pipe.ranks[1].parameters == 4 * (last + blocks[2] + blocks[3])
    # tensor parallel: the four Linear weights per block and the column-parallel biases are halved
    split = sum(
        b.attn.qkv.weight.numel() + b.attn.qkv.bias.numel() + b.attn.proj.weight.numel()
        + b.mlp.fc.weight.numel() + b.mlp.fc.bias.numel() + b.mlp.proj.weight.numel()
        for b in model.blocks
    )
    tp = estimate(model, Config(strategy="tensor", tensor_parallel=2), 2)
    assert tp.parameters == 4 * (n - split // 2)
    tp_dp = estimate(model, Config(strategy="tensor", tensor_parallel=2), 4)  # then FSDP2 over 2
    assert tp_dp.parameters == 4 * (n - split // 2) // 2


def test_tensor_plan_patterns_and_sequential_pairs() -> None:
    from mpnb.models import mlp, tiny_gpt

    model = tiny_gpt(n_layer=2)
    n = model.num_parameters()
    plan = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
    split = sum(b.mlp.fc.weight.numel() + b.mlp.fc.bias.numel() + b.mlp.proj.weight.numel()
                for b in model.blocks)
    est = estimate(model, Config(strategy="tensor", tensor_parallel=2, tensor_plan=plan), 2)
    assert est.parameters == 4 * (n - split // 2)

    seq = mlp((32, 64, 64, 10))  # Linear 0, GELU, Linear 2, GELU, Linear 4: pairs (0, 2)
    n = sum(p.numel() for p in seq.parameters())
    split = seq[0].weight.numel() + seq[0].bias.numel() + seq[2].weight.numel()
    assert estimate(seq, Config(strategy="tensor", tensor_parallel=2), 2).parameters == 4 * (n - split // 2)
    nothing = estimate(seq, Config(strategy="tensor", tensor_parallel=2, tensor_plan={"9": "colwise"}), 2)
    assert nothing.parameters == 4 * n and any("matched the tensor-parallel plan" in x for x in nothing.notes)


def test_activation_estimate_matches_saved_tensors_of_tiny_gpt() -> None:
    """The activations autograd really saves for one forward of the tiny GPT (fp32, SDPA, no dropout)."""
    import torch

    from mpnb.models import tiny_gpt

    model = tiny_gpt()
    batch = 8
    x = torch.randint(0, 256, (batch, 32))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
        torch.nn.functional.cross_entropy(out.view(-1, out.size(-1)), x.view(-1))
    measured = sum(saved.values())
    est = estimate(model, Config(micro_batch_size=batch), 1)
    assert est.activations == pytest.approx(measured, rel=0.10)


def test_single_process_trainer_matches_the_estimate() -> None:
    """mpnb.prepare on one process (no process group): the tensors it holds vs the DDP estimate."""
    import torch

    import mpnb
    from mpnb.models import synthetic_batches, tiny_gpt

    model = tiny_gpt()
    trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=Config())
    trainer.step(next(iter(synthetic_batches(batch_size=8, steps=1))))
    measured = trainer.memory_breakdown()
    est = estimate(model, Config(), 1)
    for key in ("parameters", "gradients", "optimizer"):
        assert measured[key] == pytest.approx(getattr(est, key), rel=0.05), key


ZERO3_SCRIPT = """
import json, os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
import deepspeed
from mpnb import Config, estimate
from mpnb.models import tiny_gpt
model = tiny_gpt()
cfg = Config(strategy="zero", zero_stage=3)
before = estimate(model, cfg, 1).as_dict()
ds = cfg.to_deepspeed(1)
ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=ds)
after = estimate(model, cfg, 1).as_dict()
print(json.dumps({"local": sum(p.numel() for p in model.parameters()), "before": before, "after": after}))
dist.destroy_process_group()
"""


def test_a_zero3_partitioned_module_is_estimated_at_full_size() -> None:
    """After deepspeed.initialize at stage 3 the module's own tensors are empty; ds_numel still counts."""
    import json
    import os

    out = subprocess.run([sys.executable, "-c", ZERO3_SCRIPT], capture_output=True, text=True, timeout=400,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["local"] == 0  # partitioned away
    assert result["after"] == result["before"] and result["after"]["num_params"] > 0


def test_result_shape_and_repr() -> None:
    est = estimate(PSI, Config(strategy="zero", zero_stage=3, precision="bf16"), 64, **SHAPE)
    d = est.as_dict()
    assert set(d) >= {"parameters", "gradients", "optimizer", "activations", "buffers", "total", "per_rank"}
    assert d["total"] == est.total == sum(d[k] for k in ("parameters", "gradients", "optimizer",
                                                          "activations", "buffers"))
    assert len(d["per_rank"]) == 64 and set(est.by_rank()) == set(range(64))
    assert "GiB" in repr(est) and "ZeRO-3" in repr(est)
    assert est.fits(10**13) and not est.fits(10**6)
    assert format_bytes(1_875_000_000) == "1.75 GiB" and format_bytes(512) == "512 B"


def test_bad_input_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="does not divide"):
        estimate(1000, Config(strategy="tensor", tensor_parallel=3), 4)
    with pytest.raises(ConfigError, match=r"nn\.Module or a parameter count"):
        estimate("big", Config(), 1)
    with pytest.raises(ConfigError, match="accounting must be one of"):
        estimate(1000, Config(), 1, accounting="vibes")
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        estimate(1000, Config(), 1, optimizer="lion")
    assert estimate(1000, Config(), 1).notes  # says activations were left out


_GPT2 = {"n_layer": 12, "hidden": 768, "n_head": 12, "seq_len": 1024, "vocab_size": 50257}


@pytest.mark.parametrize("name", ["num_params", "world_size", "seq_len", "micro_batch_size", "n_layer",
                                  "hidden", "n_head", "vocab_size", "largest_layer_params",
                                  "reduce_bucket_size"])
@pytest.mark.parametrize("value", [-12, 0, float("nan"), float("inf"), 7.5, "x", [8], True])
def test_sizes_must_be_positive_whole_numbers(name: str, value: object) -> None:
    args = {"num_params": 124_000_000, "world_size": 2, **_GPT2, name: value}
    num_params, world = args.pop("num_params"), args.pop("world_size")
    message = "nn.Module or a parameter count" if name == "num_params" and value in ("x", [8], True) else name
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        estimate(num_params, Config(strategy="zero", zero_stage=2), world, **args)


def test_numbers_are_read_as_people_write_them() -> None:
    exact = estimate(PSI, Config(strategy="zero", zero_stage=3), 64, n_layer=32, hidden=4096, n_head=32,
                     seq_len=2048)
    for count in (7.5e9, "7.5e9", "7_500_000_000"):
        assert estimate(count, Config(strategy="zero", zero_stage=3), 64.0, n_layer=32.0, hidden="4096",
                        n_head=32, seq_len=2048.0) == exact
    assert exact.total > 0


def test_other_arguments_are_checked() -> None:
    for kwargs, named in [({"bytes_per_param": (-1, 2, 3)}, "bytes_per_param"),
                          ({"bytes_per_param": (float("nan"), 2, 3)}, "bytes_per_param"),
                          ({"bytes_per_param": (2, 2)}, "bytes_per_param"),
                          ({"optimizer": ["adamw"]}, "optimizer"), ({"dropout": "yes"}, "dropout"),
                          ({"config": {1: 2}}, "config keys"), ({"world_size": 10**9}, "world_size")]:
        config = kwargs.pop("config", Config())
        world = kwargs.pop("world_size", 2)
        with pytest.raises(ConfigError, match=named):
            estimate(1000, config, world, **kwargs)


def test_parameter_count_needs_no_torch() -> None:
    code = ("import sys, mpnb; from mpnb import Config;"
            "e = mpnb.estimate(7_500_000_000, Config(strategy='zero', zero_stage=3), 64, n_layer=32,"
            " hidden=4096, n_head=32, seq_len=2048); repr(e); e.as_dict();"
            "assert 'torch' not in sys.modules, 'torch imported'; print(e.total > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
