"""`trainer.generate(input_ids, ...)`: text from a trained causal LM, on every rank of a %%distributed cell.

Call it on every rank with the same prompt. Sharded strategies gather weights
inside each forward (FSDP2 per unit, ZeRO-3 through DeepSpeed's hooks), which
are collectives: every rank must run the same number of forwards. Greedy
decoding (the default here) gives the same tokens on every rank, so every rank
stops at the same step; with `do_sample=True` every rank samples from the same
seed (`seed=`, default 0) for the same reason, without touching the global RNG.

Limits: pipeline stages each hold part of the model, so they cannot generate
(train, `trainer.state_dict()`, load it into a whole model in one process and
generate there); tensor parallel generates with the split model when its layers
support the shapes a KV cache gives, else raises MpnbError saying the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpnb.engine.batches import unwrap
from mpnb.errors import MpnbError

SAVE_AND_LOAD = (
    "Train, then `sd = trainer.state_dict()` (every rank calls it), and on rank 0 build the same model "
    "class, `model.load_state_dict(sd['model'])` and call `model.generate(...)` in that one process."
)


def check_can_generate(wrapped: nn.Module, strategy: str) -> nn.Module:
    """The module to generate with; else MpnbError, the same on every rank, before any forward."""
    if strategy == "pipeline":
        raise MpnbError(
            "trainer.generate does not run under strategy=pipeline: each rank holds only its stage of the "
            f"model, and generation needs the whole model at every new token. {SAVE_AND_LOAD}"
        )
    model = unwrap(wrapped)
    can = getattr(model, "can_generate", None)
    if not callable(getattr(model, "generate", None)) or (callable(can) and not can()):
        raise MpnbError(
            f"{type(model).__name__} cannot generate text: only causal language models (e.g. "
            "LlamaForCausalLM, GPT2LMHeadModel) predict the next token. Masked LMs and classifiers "
            "are evaluated with trainer.eval_step(batch) instead."
        )
    return model


def generate(
    wrapped: nn.Module, strategy: str, device: torch.device, input_ids: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """Token ids (prompt + new tokens) of the trainer's model `wrapped`, as a CPU tensor, on every rank."""
    model = check_can_generate(wrapped, strategy)
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise MpnbError(
            "trainer.generate takes input_ids as a 2-D tensor of token ids (batch, length), e.g. "
            "tokenizer(text, return_tensors='pt')['input_ids'] or torch.tensor([[ids...]])."
        )
    seed = kwargs.pop("seed", 0)
    kwargs.setdefault("do_sample", False)  # greedy: every rank picks the same tokens
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    wrapped.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # sampling draws the same numbers on every rank
            out = _run(model, input_ids.to(device), strategy, kwargs)
    finally:
        wrapped.train()
    ids = out if torch.is_tensor(out) else out.sequences  # return_dict_in_generate=True
    return ids.detach().cpu()


def _run(model: nn.Module, input_ids: torch.Tensor, strategy: str, kwargs: dict[str, Any]) -> Any:
    try:
        return model.generate(input_ids, **kwargs)
    except (RuntimeError, ValueError, AssertionError) as err:  # split layers that cannot take the shapes
        if strategy != "tensor":
            raise
        raise MpnbError(
            f"trainer.generate failed under strategy=tensor ({type(err).__name__}: {err}). The split "
            f"model cannot generate here. {SAVE_AND_LOAD}"
        ) from err
