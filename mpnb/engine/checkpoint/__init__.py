"""Sharded checkpoints on the engines: each rank writes and reads only what it holds (DCP).

`writer.save` and `reader.load` work on any Trainer through two hooks,
`Trainer.checkpoint_state()` (the live tensors DCP saves from and loads into)
and `Trainer.finish_checkpoint_load(state)`; the layout on disk is
`mpnb.checkpoints.format`.
"""
