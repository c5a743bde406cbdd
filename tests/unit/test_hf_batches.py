"""Dict batches (transformers style) in one process: the loss, the checks, and FSDP2's units for HF models."""

from __future__ import annotations

import pytest
import torch

from mpnb.engine.batches import check_batch, model_loss, takes_labels
from mpnb.errors import MpnbError
from mpnb.planning.model_shape import block_modules, shard_units

transformers = pytest.importorskip("transformers")
from mpnb.hf_models import text_batches, tiny_transformer  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return tiny_transformer("llama", num_hidden_layers=2)


@pytest.fixture(scope="module")
def batch(llama):
    return next(text_batches(llama, batch_size=4, seq_len=8, steps=1))


def test_dict_batch_uses_the_models_own_loss(llama, batch):
    want = llama(**batch).loss
    assert model_loss(llama, batch, batch["labels"], None).item() == pytest.approx(want.item(), rel=1e-6)


def test_with_a_loss_fn_the_labels_stay_out_of_the_model(llama, batch):
    seen = {}

    def loss_fn(logits, labels):
        seen["shape"], seen["labels"] = logits.shape, labels
        return logits.float().mean()

    loss = model_loss(llama, batch, batch["labels"], loss_fn)
    assert seen["shape"] == (4, 8, 256) and seen["labels"] is batch["labels"]
    assert loss.item() == pytest.approx(llama(input_ids=batch["input_ids"]).logits.mean().item(), rel=1e-6)


def test_a_batch_encoding_is_a_dict_batch(llama, batch):
    encoding = transformers.BatchEncoding(batch)
    checked = check_batch(encoding, llama, None)
    assert type(checked) is dict and set(checked) == set(batch)


def test_pairs_pass_unchanged(llama):
    pair = (torch.zeros(2, 3), torch.zeros(2))
    assert check_batch(pair, llama, None) is pair


def test_missing_labels_names_the_keys_and_the_fix(llama, batch):
    with pytest.raises(MpnbError, match=r"no 'labels' \(its keys: 'input_ids', 'attention_mask'\)") as info:
        check_batch({k: v for k, v in batch.items() if k != "labels"}, llama, None)
    assert "Add batch['labels']" in str(info.value)


def test_a_bare_model_without_loss_fn_is_refused():
    bare = transformers.LlamaModel(tiny_transformer("llama", num_hidden_layers=1).config)
    assert not takes_labels(bare)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
    with pytest.raises(MpnbError, match="LlamaModel's forward takes no `labels`") as info:
        check_batch(batch, bare, None)
    assert "loss_fn" in str(info.value) and "LlamaForCausalLM" in str(info.value)
    assert check_batch(batch, bare, lambda out, y: out.sum()) == batch  # with a loss_fn it is fine


@pytest.mark.parametrize("batch", [torch.zeros(2, 3), (torch.zeros(2), torch.zeros(2), torch.zeros(2))])
def test_neither_pair_nor_mapping(llama, batch):
    with pytest.raises(MpnbError, match="a pair \\(inputs, targets\\) or a dict of tensors"):
        check_batch(batch, llama, None)


def test_lists_in_a_dict_batch_ask_for_tensors(llama):
    with pytest.raises(MpnbError, match="return_tensors='pt'"):
        check_batch({"input_ids": [[1, 2]], "labels": [[1, 2]]}, llama, None)


@pytest.mark.parametrize(("family", "units"), [
    ("llama", ["LlamaDecoderLayer"] * 2),
    ("gpt2", ["GPT2Block"] * 2),
    ("bert-cls", ["BertEmbeddings"] + ["BertLayer"] * 2),  # _no_split_modules names both
    ("bert-mlm", ["BertLayer"] * 2),  # the embeddings are tied to the MLM decoder: not a unit of their own
])
def test_fsdp_units_come_from_no_split_modules(family, units):
    overrides = {"n_layer": 2} if family == "gpt2" else {"num_hidden_layers": 2}
    model = tiny_transformer(family, **overrides)
    assert [type(u).__name__ for u in shard_units(model, [])] == units
    wrapped = shard_units(model, [units[-1]])  # config.fsdp_wrap wins over _no_split_modules
    assert [type(u).__name__ for u in wrapped] == [units[-1]] * 2
    assert len(block_modules(model)) == 2  # activation checkpointing: the repeated blocks


def test_a_trainer_steps_and_evaluates_on_dict_batches_in_one_process():
    import mpnb

    model = tiny_transformer("gpt2", n_layer=2)
    batches = list(text_batches(model, batch_size=4, seq_len=8, steps=2))
    want = model(**batches[0]).loss.item()
    trainer = mpnb.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"strategy": "ddp"})
    assert trainer.eval_step(transformers.BatchEncoding(batches[0])) == pytest.approx(want, rel=1e-6)
    assert trainer.step(batches[0]) == pytest.approx(want, rel=1e-6)
    assert trainer.eval_step(batches[0]) < want  # the step changed the weights
    prompt = batches[1]["input_ids"][:1, :4]
    ids = trainer.generate(prompt, max_new_tokens=3)
    assert ids.device.type == "cpu" and ids.shape == (1, 7)
    assert torch.equal(ids, model.generate(prompt, max_new_tokens=3, do_sample=False))
