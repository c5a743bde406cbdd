"""Tiny Hugging Face transformers models and dict batches as transformers users have them, for tests.

Every model is built from a small config with random weights (nothing is
downloaded) and dropout off, so runs under different strategies are comparable.
With real weights, build the model with `from_pretrained` instead: `mpnb.prepare`
reads the same config and plans.

A batch is a dict as a tokenizer plus collator yields it (`input_ids`,
`attention_mask`, `labels`, and `token_type_ids` for BERT), and the model
computes its own loss from `labels`. Every row has the same number of labelled
positions, so the mean of the data-parallel ranks' losses equals the loss of
the whole batch (with padding, ranks would average over different counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# family -> (config class, model class, config fields); hidden 32, 2-4 layers, vocabulary 256 (bytes)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {
        "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "bert-mlm": ("BertConfig", "BertForMaskedLM", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
    "bert-cls": ("BertConfig", "BertForSequenceClassification", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "classifier_dropout": 0.0, "num_labels": 3}),
}
VOCAB = 256
MASK_TOKEN = 4  # the "[MASK]" byte of the masked-LM batches (any id < VOCAB works on random weights)


def tiny_transformer(family: str = "llama", seed: int = 0, **overrides: Any) -> nn.Module:
    """A small `transformers` model of `family` (see FAMILIES) with seeded random weights.

    `overrides` change config fields, e.g. `num_hidden_layers=2` or `torch_dtype`.
    Every rank that builds it with the same seed holds the same weights.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, **{**fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    if family == "gpt2":  # transformers finds no loss type in the class name and warns once per process
        model.loss_type = "ForCausalLM"
    return model


def text_batches(
    model: nn.Module, batch_size: int = 8, seq_len: int = 32, steps: int = 5, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """`steps` deterministic global batches for `model`, as dicts with `labels` the model learns from.

    Causal LMs get `labels = input_ids` (the model shifts them); masked LMs get a
    fixed number of masked positions per row and -100 elsewhere; sequence
    classifiers get one class per row (`config.num_labels` classes).
    """
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    for _ in range(steps):
        ids = torch.randint(5, VOCAB, (batch_size, seq_len), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        kind = type(model).__name__
        if kind.endswith("ForMaskedLM"):
            masked = torch.rand(batch_size, seq_len, generator=generator).argsort(dim=1)[:, : seq_len // 8]
            labels = torch.full_like(ids, -100)
            labels.scatter_(1, masked, ids.gather(1, masked))
            batch["input_ids"] = ids.scatter(1, masked, MASK_TOKEN)
            batch["labels"] = labels
        elif kind.endswith("ForSequenceClassification"):
            batch["labels"] = torch.randint(0, config.num_labels, (batch_size,), generator=generator)
        else:
            batch["labels"] = ids.clone()
        if getattr(config, "type_vocab_size", 0):
            batch["token_type_ids"] = torch.zeros_like(ids)
        yield batch
