"""transformers models train under DDP, FSDP2 and ZeRO 0-3 like one process does, on dict batches.

One real 2-engine CPU cluster (gloo, real DeepSpeed) for the module. Each family
of `mpnb.hf_models` trains 5 AdamW steps on the same global dict batches (8 rows,
4 per rank) with the model's own loss (`outputs.loss`, no loss_fn); the first 5
losses must equal `local_hf_run` (one process, no process group) to 1e-4 relative
in fp32. bf16 (FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 shards and
gradient reduction) is compared with the fp32 reference within 2e-2: bf16 keeps
8 bits of mantissa (~4e-3 relative per rounding), and 5 steps of a 4-layer model
accumulate a few of them. Each run's result is kept (`hf_runs.CachedRuns`), so the memory
test compares the trainer's per-rank bytes with `mpnb.estimate` without training
again. Also: bad batches fail with one MpnbError on both ranks and the next cell
trains; `trainer.generate` gives the ids one process gives; a cell that trains
GPT-2 shows only what it printed.
"""

from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output

from mpnb.execution.output import strip_ansi

from . import hf_runs
from .strategy_runs import assert_close

pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "gpt2", "bert-mlm", "bert-cls"]
# strategy name -> config; micro_batch_size x 2 ranks (x accumulation) = the global batch of 8 rows
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "micro_batch_size": 4},
    "fsdp": {"strategy": "fsdp", "micro_batch_size": 4},
    **{f"zero{s}": {"strategy": "zero", "zero_stage": s, "micro_batch_size": 4} for s in range(4)},
}
EXTRA: dict[str, tuple[str, dict[str, Any]]] = {  # case id -> (family, config)
    "llama-zero2-offload": ("llama", {**STRATEGIES["zero2"], "offload": "optimizer"}),
    "llama-zero2-accumulate": ("llama", {**STRATEGIES["zero2"], "micro_batch_size": 2,
                                         "grad_accum_steps": 2}),
    "llama-fsdp-checkpointing": ("llama", {**STRATEGIES["fsdp"], "activation_checkpointing": True}),
    "llama-fsdp-bf16": ("llama", {**STRATEGIES["fsdp"], "precision": "bf16"}),
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"{f}-{s}": (f, cfg) for f in FAMILIES for s, cfg in STRATEGIES.items()},
    **EXTRA,
}
BF16_REL = 2e-2
RUNS = hf_runs.CachedRuns(CASES)

GENERATE_CODE = '''
PROMPT = [[5, 17, 42, 99, 3, 250], [200, 3, 77, 150, 8, 8]]

def hf_generate(config, family="llama", steps=2, seed=0, direct=False, **kwargs):
    """Train `steps` steps, then generate 8 tokens per prompt row (the model's own generate if direct)."""
    net = tiny_transformer(family, seed)
    trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), config=config)
    for batch in text_batches(net, 8, 32, steps, seed):
        trainer.step(batch)
    prompt = torch.tensor(PROMPT)
    args = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 8, **kwargs}
    if direct:
        return net.generate(prompt, do_sample=False, **args).tolist()
    return trainer.generate(prompt, **args).tolist()
'''


@pytest.fixture(scope="module")
def view(cluster):
    v = cluster.view()
    hf_runs.install(v)
    v.execute(GENERATE_CODE, block=True)
    return v


@pytest.fixture(scope="module")
def ip(ipython, cluster):
    return ipython


def run(ip, source: str) -> tuple[Any, str]:
    """Run one cell in shell `ip`; return (result, stdout and stderr without colours)."""
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout + cap.stderr)


# ---- first in the module: transformers' warn-once lines fire once per engine process --------------
GPT2_CELL = """\
%%distributed
from mpnb.hf_models import tiny_transformer, text_batches
model = tiny_transformer("gpt2", seed=0)
trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                       config={"strategy": "fsdp", "micro_batch_size": 4})
for batch in text_batches(model, 8, 16, 2):
    loss = trainer.step(batch)
ids = trainer.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
print("trained", loss > 0, "generated", ids.shape[1])
"""
PROBE = """\
import warnings, transformers
transformers.utils.logging.get_logger("transformers.mpnb_probe").warning("probe record")
warnings.warn_explicit("probe warning", UserWarning, transformers.__file__, 1)
print("probed")
"""


def test_a_transformers_cell_shows_only_what_the_user_printed(ip):
    res, out = run(ip, GPT2_CELL)
    assert res.success, out
    assert out.strip() == "[ranks 0,1] trained True generated 7", out
    res, out = run(ip, "%%distributed\n" + PROBE)
    assert res.success and out.strip() == "[ranks 0,1] probed", out
    # the same library output is there when the cell asks for it
    res, out = run(ip, "%%distributed --verbose\n" + PROBE)
    assert res.success and "probe record" in out and "UserWarning: probe warning" in out, out


# ---- losses and memory, per family and strategy -----------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_single_process(view, case):
    family, config = CASES[case]
    results = RUNS.results(view, case)
    losses = results[0]["losses"]
    assert len(losses) == 5 and results[1]["losses"] == losses, "every rank reports the same global loss"
    if config.get("precision") == "bf16":
        assert losses != RUNS.reference(family), "bf16 really ran in lower precision"
        assert_close(losses, RUNS.reference(family), rel=BF16_REL)
    else:
        assert_close(losses, RUNS.reference(family), rel=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_memory_matches_estimate(view, case):
    hf_runs.assert_estimate_agrees(RUNS.results(view, case), 0.05)


# ---- generation after training ----------------------------------------------------------------------
def local_generate() -> list[list[int]]:
    """The model's own `generate` after the same 2 steps, in this process."""
    namespace: dict[str, Any] = {}
    exec(hf_runs.ENGINE_CODE + GENERATE_CODE, namespace)
    return namespace["hf_generate"]({"strategy": "ddp"}, direct=True)


GENERATE_CONFIGS = {
    **{s: STRATEGIES[s] for s in ("ddp", "fsdp", "zero2", "zero3")},
    "tensor": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 8},  # transformers' TP
}


@pytest.mark.parametrize("strategy", list(GENERATE_CONFIGS))
def test_generate_after_training_equals_one_process(view, strategy):
    view.execute(f"ids = hf_generate({GENERATE_CONFIGS[strategy]!r})", block=True)
    got = view.pull("ids", block=True)
    want = local_generate()
    assert len(want[0]) == 6 + 8
    assert got[0] == got[1] == want, (got, want)


def test_sampling_draws_the_same_tokens_on_every_rank(view):
    view.execute(f"ids = hf_generate({STRATEGIES['fsdp']!r}, steps=0, do_sample=True, seed=7)", block=True)
    first, second = view.pull("ids", block=True)
    assert first == second and len(first[0]) == 6 + 8


# ---- bad input: one MpnbError for both ranks, before any collective; the next cell trains -----------
SETUP_CELL = """\
%%distributed
import transformers
from mpnb.hf_models import tiny_transformer, text_batches
llama = tiny_transformer("llama", seed=0)
batch = next(text_batches(llama, 8, 16, 1))
print("ready")
"""
BAD_CELLS = {
    "bare model, no loss_fn": (
        "bare = mpnb.prepare(transformers.LlamaModel(llama.config), config={'strategy': 'fsdp', "
        "'micro_batch_size': 4})\nbare.step(batch)\n",
        ["LlamaModel's forward takes no `labels`", "loss_fn", "LlamaForCausalLM"],
    ),
    "no labels": (
        "trainer.step({k: v for k, v in batch.items() if k != 'labels'})\n",
        ["no 'labels' (its keys: 'input_ids', 'attention_mask')", "Add batch['labels']"],
    ),
    "neither pair nor dict": (
        "trainer.step(batch['input_ids'])\n",
        ["a pair (inputs, targets) or a dict of tensors with 'labels'", "got a Tensor"],
    ),
    "bert cannot generate": (
        "mpnb.prepare(tiny_transformer('bert-mlm'), config={'strategy': 'ddp', 'micro_batch_size': 4})"
        ".generate(batch['input_ids'])\n",
        ["BertForMaskedLM cannot generate text", "causal language models"],
    ),
    "pipeline cannot generate": (
        "from mpnb.models import tiny_gpt\n"
        "mpnb.prepare(tiny_gpt(0), config={'strategy': 'pipeline', 'pipeline_stages': 2, 'microbatches': 2})"
        ".generate(batch['input_ids'])\n",
        ["does not run under strategy=pipeline", "trainer.state_dict()", "model.generate"],
    ),
}


def engine_counts(cluster) -> list[int]:
    """Each engine's IPython execution count: it moves by one for every cell the engine ran."""
    return cluster.view().apply_sync(lambda: __import__("IPython").get_ipython().execution_count)


def test_bad_input_is_one_clear_error_and_the_cluster_stays_usable(ip, cluster):
    res, out = run(ip, SETUP_CELL)
    assert res.success and out.strip() == "[ranks 0,1] ready", out
    res, out = run(ip, "%%distributed\ntrainer = mpnb.prepare(llama, config={'strategy': 'zero', "
                       "'zero_stage': 3, 'micro_batch_size': 4})\nprint('prepared')\n")
    assert res.success, out
    before = engine_counts(cluster)
    for name, (code, phrases) in BAD_CELLS.items():
        res, out = run(ip, "%%distributed\n" + code)
        assert not res.success, name
        assert out.count("[ranks 0,1] MpnbError: ") == 1, (name, out)  # the same error on both ranks
        for phrase in phrases:
            assert phrase in out, (name, phrase, out)
    res, out = run(ip, "%%distributed\nprint('loss', round(trainer.step(batch), 3) > 0, trainer.steps)\n")
    assert res.success and out.strip() == "[ranks 0,1] loss True 1", out  # no collective was left half done
    after = engine_counts(cluster)
    assert [a - b for a, b in zip(after, before, strict=True)] == [len(BAD_CELLS) + 1] * 2
