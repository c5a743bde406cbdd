"""Strategies: one module per way of spreading a model over ranks.

Each module has `prepare(model, optimizer, config, ctx, loss_fn) -> Trainer`;
`mpnb.engine.prepare` picks the module named by `config.strategy`. Shared
pieces (the device mesh, rebuilding an optimizer over new parameters, finding
a model's repeated blocks, activation checkpointing) live in `common.py`, and
`compose.py` applies tensor, then pipeline, then data parallelism in the
order torchtitan uses.
"""

STRATEGY_MODULES = {
    "ddp": "mpnb.engine.strategies.ddp",
    "fsdp": "mpnb.engine.strategies.fsdp",
    "zero": "mpnb.engine.strategies.zero",
    "pipeline": "mpnb.engine.strategies.pipeline",
    "tensor": "mpnb.engine.strategies.tensor",
}
