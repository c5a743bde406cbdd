"""One transformers training run, as code every rank executes and this process runs as the reference.

`hf_run` builds a tiny model of a family (`mpnb.hf_models`), trains it on dict
batches with the model's own loss, and returns the losses, what the trainer
holds per rank, and what `mpnb.estimate` predicted for this rank before prepare.
"""

from __future__ import annotations

from typing import Any

ENGINE_CODE = '''
import torch
import mpnb
from mpnb.hf_models import tiny_transformer, text_batches

def hf_run(config, family="llama", steps=5, lr=1e-2, batch=8, seq_len=32, seed=0, overrides=None):
    """Train `steps` steps of `family` under `config` on fixed dict batches; return losses and memory."""
    net = tiny_transformer(family, seed, **(overrides or {}))
    batches = list(text_batches(net, batch, seq_len, steps, seed))
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    predicted = mpnb.estimate(net, config, world).ranks[rank]
    trainer = mpnb.prepare(net, opt, config=config)
    losses = [trainer.step(b) for b in batches]
    return {"losses": losses, "breakdown": trainer.memory_breakdown(),
            "estimate": predicted.held()}  # device + offloaded bytes, as memory_breakdown() counts them
'''


def install(view: Any) -> None:
    view.execute(ENGINE_CODE, block=True)


def local_hf_run(**kwargs: Any) -> dict[str, Any]:
    """`hf_run` in this process (no process group): the single-process reference."""
    namespace: dict[str, Any] = {}
    exec(ENGINE_CODE, namespace)
    kwargs.setdefault("config", {"strategy": "ddp"})
    return namespace["hf_run"](**kwargs)


def cluster_hf_run(view: Any, config: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    """`hf_run` on every rank at once; one result per rank, in rank order."""
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    view.execute(f"hf_result = hf_run({config!r}{args})", block=True)
    return view.pull("hf_result", block=True)


class CachedRuns:
    """Each case of a test module trained once (its loss and memory tests read the same results),
    and the single-process reference losses once per family."""

    def __init__(self, cases: dict[str, tuple[str, dict[str, Any]]]) -> None:
        self.cases = cases  # case id -> (family, config)
        self._results: dict[str, list[dict[str, Any]]] = {}
        self._references: dict[str, list[float]] = {}

    def results(self, view: Any, case: str) -> list[dict[str, Any]]:
        """The case's per-rank results, trained on the first call."""
        if case not in self._results:
            family, config = self.cases[case]
            self._results[case] = cluster_hf_run(view, config, family=family)
        return self._results[case]

    def reference(self, family: str) -> list[float]:
        """`local_hf_run`'s losses for `family`: one process, the same batches."""
        if family not in self._references:
            self._references[family] = local_hf_run(family=family)["losses"]
        return self._references[family]


def assert_estimate_agrees(results: list[dict[str, Any]], within: float = 0.05) -> None:
    """Per rank, what the trainer holds equals `mpnb.estimate`'s prediction within `within` (relative)."""
    for rank, result in enumerate(results):
        for part in ("parameters", "gradients", "optimizer"):
            held, predicted = result["breakdown"][part], result["estimate"][part]
            assert abs(held - predicted) <= within * max(held, 1), (
                f"rank {rank} {part}: trainer holds {held} B, mpnb.estimate predicted {predicted} B"
            )
