"""One training run, as code the engines execute (like a `%%distributed` cell) or this process runs.

The same `mpnb_run` runs on every rank of a cluster (through `view.execute`)
and, without a process group, in the test process itself: that is the
single-process reference the strategies must match.
"""

from __future__ import annotations

from typing import Any

ENGINE_CODE = '''
import itertools
import torch
import mpnb
from mpnb.models import mlp, synthetic_batches, synthetic_regression, tiny_gpt

def mpnb_run(config, steps=20, optim="sgd", lr=0.1, batch=8, seed=0, model="gpt", start=0,
             load=None, keep_state=False, hf=False, resume=None, save=None):
    """Train `steps` steps on global batches [start, start+steps) of a fixed stream; return losses etc."""
    global mpnb_state
    if hf:
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(seed)
        net = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        net = tiny_gpt(seed) if model == "gpt" else mlp(seed=seed)
    n_params = sum(p.numel() for p in net.parameters())
    if optim == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
    trainer = mpnb.prepare(net, opt, config=config, resume=resume)
    if load is not None:
        trainer.load_state_dict(load)
    if model == "gpt":
        data = synthetic_batches(batch_size=batch, steps=start + steps, seed=seed)
    else:
        data = synthetic_regression(batch_size=batch, steps=start + steps, seed=seed)
    losses = [trainer.step(b) for b in itertools.islice(data, start, None)]
    if save is not None:
        trainer.save(save)
    if keep_state:
        mpnb_state = trainer.state_dict()
    counts = trainer.parameter_counts()
    return {"losses": losses, "breakdown": trainer.memory_breakdown(), "n_params": n_params,
            "counts": (counts.total, counts.local, str(counts)),
            "eval": trainer.eval_step(next(iter(synthetic_batches(batch_size=batch, steps=1, seed=seed + 1))))
                    if model == "gpt" else None}
'''


def local_run(**kwargs: Any) -> dict[str, Any]:
    """`mpnb_run` in this process (no process group): the single-process reference."""
    namespace: dict[str, Any] = {}
    exec(ENGINE_CODE, namespace)
    kwargs.setdefault("config", {"strategy": "ddp"})
    return namespace["mpnb_run"](**kwargs)


def install(view: Any) -> None:
    view.execute(ENGINE_CODE, block=True)


def cluster_run(
    view: Any, config: dict[str, Any], *, code: dict[str, str] | None = None, **kwargs: Any
) -> list[dict[str, Any]]:
    """`mpnb_run` on every rank at once; returns one result per rank, in rank order.

    `code` passes arguments as engine-side expressions (e.g. ``{"load": "mpnb_state"}``).
    """
    args = ", ".join(
        [f"{k}={v!r}" for k, v in kwargs.items()] + [f"{k}={v}" for k, v in (code or {}).items()]
    )
    view.execute(f"mpnb_result = mpnb_run({config!r}{', ' if args else ''}{args})", block=True)
    return view.pull("mpnb_result", block=True)


def save_after_steps(view: Any, folder: Any, configs: dict[str, dict[str, Any]], want: list[float],
                     **kwargs: Any) -> dict[str, Any]:
    """One checkpoint per config in `folder`, each after the `len(want)` steps whose losses must be `want`."""
    paths = {}
    for name, config in configs.items():
        paths[name] = folder / name
        first = cluster_run(view, config, steps=len(want), save=str(paths[name]), **kwargs)
        assert_close(first[0]["losses"], want, rel=1e-5)
    return paths


def assert_close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= rel, f"worst relative difference {worst:.2e} > {rel:.0e}\n got  {got}\n want {want}"
