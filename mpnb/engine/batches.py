"""What `trainer.step(batch)` accepts, and the loss of one forward: one place every strategy uses.

A batch is either the pair `(inputs, targets)` (inputs: a tensor, a tuple of
positional arguments or a dict of keyword arguments; loss = `loss_fn(output,
targets)`, cross-entropy by default), or a mapping as a transformers tokenizer
plus collator gives it (`input_ids`, `attention_mask`, `labels`, ...). With a
mapping and no `loss_fn` the model is called as `model(**batch)` and computes
its own loss (`outputs.loss`); with a `loss_fn`, the labels are kept out of the
model's arguments and the loss is `loss_fn(logits, labels)`.

The checks here read only types, keys and the forward's signature (no forward
pass, no collective), so a bad batch fails the same way on every rank and the
process group stays usable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mpnb.errors import MpnbError

LABELS = "labels"
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Default loss: cross-entropy over the last dimension (logits of any rank)."""
    return nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))


def is_dict_batch(inputs: Any) -> bool:
    """Inputs of a mapping batch (they carry their labels), as opposed to the inputs of a pair.

    A pair whose inputs are a dict holding "labels" is read the same way (the model's own loss).
    """
    return isinstance(inputs, dict) and LABELS in inputs


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP, a DeepSpeed engine or torch.compile (FSDP2 shards it in place)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine"):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def takes_labels(model: nn.Module) -> bool:
    """The model's forward has a `labels` parameter, so it can compute its own loss."""
    try:
        params = inspect.signature(unwrap(model).forward).parameters
    except (TypeError, ValueError):  # no signature to read: let the forward decide
        return True
    return LABELS in params


def check_batch(batch: Any, model: nn.Module, loss_fn: LossFn | None) -> Any:
    """The batch as a plain dict or an (inputs, targets) pair; MpnbError naming the fix otherwise."""
    if isinstance(batch, Mapping):
        batch = dict(batch)  # a transformers BatchEncoding is a UserDict
        _check_mapping(batch, model, loss_fn)
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch
    got = f"a {type(batch).__name__} of {len(batch)} items" if isinstance(batch, (tuple, list)) else (
        f"a {type(batch).__name__}")
    raise MpnbError(
        f"trainer.step needs a batch that is a pair (inputs, targets) or a dict of tensors with 'labels' "
        f"(what a transformers tokenizer and collator give); got {got}. Pass step((inputs, targets)) "
        "or step({'input_ids': ..., 'labels': ...})."
    )


def _check_mapping(batch: dict[str, Any], model: nn.Module, loss_fn: LossFn | None) -> None:
    keys = ", ".join(repr(k) for k in batch) or "none"
    if LABELS not in batch:
        raise MpnbError(
            f"This dict batch has no 'labels' (its keys: {keys}), so there is nothing to compute a loss "
            "against. Add batch['labels']: the token ids for a causal LM (labels = input_ids; the model "
            "shifts them), the masked tokens with -100 elsewhere for a masked LM, one class per row "
            "for a sequence classifier."
        )
    not_tensors = [k for k, v in batch.items() if not torch.is_tensor(v)]
    if not_tensors:
        raise MpnbError(
            f"batch[{not_tensors[0]!r}] is a {type(batch[not_tensors[0]]).__name__}, not a tensor; every "
            "value of a dict batch must be a tensor with one row per example. Tokenize with "
            "return_tensors='pt' (or collate into tensors)."
        )
    if loss_fn is None and not takes_labels(model):
        name = type(unwrap(model)).__name__
        raise MpnbError(
            f"{name}'s forward takes no `labels`, so it cannot compute a loss from this dict batch and no "
            f"loss_fn was given. Pass loss_fn=... to mpnb.prepare (it gets the logits and batch['labels']), "
            f"or use the class with a head that computes its loss (e.g. {_head_hint(name)})."
        )


def _head_hint(name: str) -> str:
    family = name[: -len("Model")] if name.endswith("Model") and name != "Model" else ""
    if not family:
        return "a *ForCausalLM, *ForMaskedLM or *ForSequenceClassification class"
    return f"{family}ForCausalLM, {family}ForMaskedLM or {family}ForSequenceClassification, as the model has"


def call_model(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Inputs may be one tensor, a tuple of positional args or a dict of keyword args (HF style)."""
    if isinstance(inputs, dict):
        out = model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        out = model(*inputs)
    else:
        out = model(inputs)
    return out.logits if hasattr(out, "logits") else out


def model_loss(model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The loss of one forward of `model` (plain, DDP, FSDP2, a DeepSpeed engine) on a batch's inputs."""
    if not is_dict_batch(inputs):
        return (loss_fn or cross_entropy)(call_model(model, inputs), targets)
    if loss_fn is not None:
        features = {k: v for k, v in inputs.items() if k != LABELS}
        return loss_fn(call_model(model, features), inputs[LABELS])
    return _own_loss(model(**inputs), type(unwrap(model)).__name__)


def _own_loss(out: Any, name: str) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    first = out[0] if isinstance(out, (tuple, list)) and out else None
    if loss is None and torch.is_tensor(first) and first.dim() == 0:
        loss = first  # return_dict=False: the loss comes first when labels were passed
    if loss is None:
        raise MpnbError(
            f"{name} was given labels but returned no loss. Pass loss_fn=... to mpnb.prepare to compute "
            "it from the logits and batch['labels']."
        )
    return loss
