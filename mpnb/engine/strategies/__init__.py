"""Strategies: one module per way of spreading a model over ranks.

Each module has `prepare(model, optimizer, config, dims, ctx, loss_fn) -> Trainer`
(`dims` is the config's `ParallelDims` on this world, `ctx` this rank's
`EngineContext`); `mpnb.engine.prepare` picks the module for `config.strategy`
from `mpnb.engine.prepare.STRATEGY_MODULES`. Shared pieces (rebuilding an optimizer over new
parameters, a Trainer on the data-parallel mesh dim, activation checkpointing)
live in `common.py`. Model-parallel strategies apply their split first and
FSDP2 over the remaining data-parallel ranks last, in the order torchtitan
uses: tensor.py and pipeline.py call fsdp.py's `apply_fsdp` after splitting.
"""
