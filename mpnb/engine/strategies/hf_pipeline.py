"""Pipeline stages of a transformers causal LM, cut where `config.base_model_pp_plan` says.

The plan names the base model's embeddings, its repeated `layers` and its
final norm. The model object stays whole in name (parameters keep names like
`model.layers.3.mlp.up_proj.weight`, so checkpoints load across strategies);
each stage keeps:
- its own slice of `layers`, in a ModuleList keyed by the original indices
  (the model's forward iterates `self.layers[: num_hidden_layers]`, which
  slices whatever the list holds);
- the token embeddings on the first stage only (later stages take the hidden
  state as `inputs_embeds`);
- the final norm and the LM head on the last stage only (nn.Identity elsewhere).

The stage's forward replaces the model's: first stage `input_ids -> hidden`,
middle `hidden -> hidden`, last `hidden -> logits`. Each stage builds the
causal mask and rotary embeddings itself from the hidden state and the
`attention_mask` the schedule hands every stage (the batch's other keys travel
as schedule kwargs, split into microbatches like the inputs).

Tied embeddings (Qwen2): the first stage's embedding and the last stage's head
are copies of one parameter, so after backward the two gradients are summed
between those stages (`TiedGradients`), as Megatron does; both copies then take
the same optimizer step and stay equal.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpnb.engine.batches import LABELS, LossFn, cross_entropy
from mpnb.planning import hf_plans
from mpnb.planning.parallel_dims import ParallelDims

INPUT_IDS = "input_ids"


def block_names(model: nn.Module, pp: int) -> list[str]:
    """Names of the layers a pipeline cuts between ("model.layers.0", ...); MpnbError if it cannot."""
    blocks_name, count = hf_plans.check_pipeline(model, pp)
    return [f"{blocks_name}.{i}" for i in range(count)]


def split_hf_model(model: nn.Module, blocks: list[str], keep: range, first: bool, last: bool) -> nn.Module:
    """Keep the layers `keep` (indices into `blocks`) and this stage's ends, in place; the same model."""
    base = getattr(model, model.base_model_prefix)
    container = blocks[0].rsplit(".", 1)[0].split(".", 1)[1]  # "model.layers.0" -> "layers"
    layers = base.get_submodule(container)
    kept = nn.ModuleList()
    # keyed by the original index: parameter names stay "model.layers.3...." on every stage
    kept._modules = OrderedDict((str(i), layers[i]) for i in keep)
    setattr(base, container, kept)
    if not first:
        base.embed_tokens = None  # later stages take the hidden state as inputs_embeds
    if not last:
        base.norm = nn.Identity()
        model.lm_head = nn.Identity()
    install_stage_forward(model, first, last)
    return model


def install_stage_forward(model: nn.Module, first: bool, last: bool) -> None:
    """Replace `model.forward` (this instance only) with what its stage computes."""
    full_forward = model.forward
    base = getattr(model, model.base_model_prefix)

    @functools.wraps(full_forward)  # keeps the signature: `labels` shows, as the batch checks expect
    def stage_forward(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs.pop(LABELS, None)  # the schedule hands labels to the loss as its target, never here
        kwargs["use_cache"] = False
        if last:
            return full_forward(**{_input_key(first): x}, **kwargs).logits
        return base(**{_input_key(first): x}, **kwargs).last_hidden_state

    model.forward = stage_forward


def _input_key(first: bool) -> str:
    return INPUT_IDS if first else "inputs_embeds"


class StageLoss:
    """The last stage's loss, chosen as `trainer.step` chooses it without a pipeline.

    A dict batch and no `loss_fn`: the model's own loss (`model.loss_function`,
    shifted cross-entropy for a causal LM, as `model(**batch).loss`); otherwise
    `loss_fn`, or cross-entropy for an (inputs, targets) pair. The trainer sets
    `own` for each batch before the schedule runs.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None) -> None:
        self.model, self.loss_fn, self.own = model, loss_fn, True
        self.vocab = model.config.get_text_config().vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(logits, labels)
        if self.own:
            return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.vocab)
        return cross_entropy(logits, labels)


def schedule_inputs(inputs: dict[str, Any], first: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of `schedule.step` for a dict batch: input_ids go in on the first stage only.

    Every other key but the labels (attention_mask, position_ids, ...) is a kwarg
    on every stage; the labels are the last stage's `target`.
    """
    kwargs = {k: v for k, v in inputs.items() if k not in (INPUT_IDS, LABELS)}
    return ((inputs[INPUT_IDS],) if first else ()), kwargs


def tied_head(model: nn.Module) -> bool:
    """The LM head's weight is the input embedding's (tie_word_embeddings)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


class TiedGradients:
    """Sums the tied embedding/head gradient between the first and the last stage of each pipeline.

    Built on every rank in the same order (it creates process groups); ranks of
    middle stages hold no copy and do nothing at `sync`.
    """

    def __init__(self, dims: ParallelDims, rank: int, stage: int) -> None:
        self.group: Any = None
        for j in range(dims.dp):  # pipeline outermost in the mesh: stage s, dp index j is rank s*dp + j
            ranks = [j, (dims.pp - 1) * dims.dp + j]
            group = dist.new_group(ranks)
            if rank in ranks:
                self.group = group
        self.first, self.last = stage == 0, stage == dims.pp - 1

    def sync(self, model: nn.Module) -> None:
        if not (self.first or self.last):
            return
        module = model.get_input_embeddings() if self.first else model.get_output_embeddings()
        grad = module.weight.grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.group)
