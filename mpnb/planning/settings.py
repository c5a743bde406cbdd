"""`Settings`: the fields of `mpnb.Config` and what follows from them alone.

`Config` adds editing, validation and conversions on top; the modules those
use (`config_values`, `config_checks`, `codegen`, `ds_config`) read a
`Settings`, so none of them imports `config`. Torch-free.

How the settings combine (the order follows torchtitan: tensor, then pipeline,
then data parallel):

- `strategy` is one of ddp, fsdp, zero, pipeline, tensor.
- `pipeline_stages` (pp) and `tensor_parallel` (tp) are the model-parallel
  degrees; the data-parallel degree is what remains:
  ``data_parallel = world_size // (pipeline_stages * tensor_parallel)``.
- ddp, fsdp and zero are pure data parallelism: pp = tp = 1, every rank is a
  data-parallel rank. `zero_stage` (0-3) applies to strategy=zero only
  (DeepSpeed); FSDP2 is ZeRO-3 like with `reshard_after_forward=True` and
  ZeRO-2 like with False.
- strategy=pipeline needs pp >= 2. With pp < world_size each stage is
  sharded with FSDP2 over the data-parallel ranks of a 2-D (pp, dp) mesh
  (pipeline outermost; DDP around a stage miscounts gradients with several
  microbatches), so model states are ~1/(pp·dp) per rank. `micro_batch_size`
  is what one replica takes per step; the schedule splits it into
  `microbatches` equal chunks, so it must divide evenly and there must be at
  least as many microbatches as stages.
- strategy=tensor needs tp >= 2 (Megatron-style column/row sharding inside each
  block). With tp < world_size it composes with FSDP2 over the remaining ranks
  on a 2-D (dp, tp) mesh; tensor-parallel ranks share the same batch.
- `offload` (none, optimizer, parameters) is for zero and fsdp only. DeepSpeed:
  optimizer needs stage >= 1, parameters needs stage 3 and offloads the
  optimizer too. FSDP2's CPUOffloadPolicy moves parameters, gradients and the
  optimizer step together, so fsdp accepts offload=parameters only.
- The global batch is ``micro_batch_size * grad_accum_steps * data_parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpnb.planning.config_values import normalize
from mpnb.planning.parallel_dims import ParallelDims, Strategy

_TIMES = "\u00d7"  # the multiplication sign, spelled out for the linter


@dataclass
class Settings:
    """Every setting of a parallel training run (`mpnb.Config` is the class to use).

    `strategy` picks the data-parallel flavour (ddp, fsdp, zero) or the model
    split (pipeline, tensor); `pipeline_stages` and `tensor_parallel` are the
    model-parallel degrees and the data-parallel degree is what remains of the
    world size (see `data_parallel`). The module docstring says how they combine.
    """

    strategy: Strategy = Strategy.DDP
    zero_stage: int = 0
    # FSDP2: free the unsharded parameters after forward (ZeRO-3 like) or keep them (ZeRO-2 like)
    reshard_after_forward: bool = True
    # FSDP2: module class names to shard as one unit each; empty = the model's repeated blocks
    fsdp_wrap: list[str] = field(default_factory=list)
    pipeline_stages: int = 1
    pipeline_schedule: str = "gpipe"
    microbatches: int = 1
    # pipeline: module names where a new stage starts; empty = split the sequential blocks evenly
    pipeline_split_points: list[str] = field(default_factory=list)
    tensor_parallel: int = 1
    # tensor: {module path: "colwise" | "rowwise"}; empty = the built-in plan for known layers
    tensor_plan: dict[str, str] = field(default_factory=dict)
    precision: str = "fp32"
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    activation_checkpointing: bool = False
    offload: str = "none"

    def __post_init__(self) -> None:
        # a value that means one thing becomes the field's type ("zero" the enum member, "8" the int 8),
        # so nothing downstream sees text where it expects a number; anything else stays for `problems`
        normalize(self)

    # ------------------------------------------------------------------ derived sizes

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The pipeline, data- and tensor-parallel degrees of this config on `world_size` ranks."""
        return ParallelDims.from_config(self, world_size)

    def data_parallel(self, world_size: int) -> int:
        """Ranks that each see a different slice of the data."""
        return self.parallel_dims(world_size).dp

    def global_batch_size(self, world_size: int) -> int:
        """Samples per optimizer step across the whole cluster."""
        return self.micro_batch_size * self.grad_accum_steps * self.data_parallel(world_size)

    def summary(self, world_size: int | None = None) -> str:
        """One line for a status bar, e.g. ``ZeRO-2 · fp32 · mb 8 \u00d7 accum 1``."""
        if self.strategy == Strategy.ZERO:
            head = f"ZeRO-{self.zero_stage}"
        elif self.strategy == Strategy.FSDP:
            head = "FSDP" if self.reshard_after_forward else "FSDP (no reshard)"
        elif self.strategy == Strategy.PIPELINE:
            head = (f"Pipeline {self.pipeline_stages} stages "
                    f"({self.pipeline_schedule}, {self.microbatches} µb)")
        elif self.strategy == Strategy.TENSOR:
            head = f"TP {self.tensor_parallel}"
        else:
            head = self.strategy.upper()
        if world_size is not None and self.strategy in (Strategy.PIPELINE, Strategy.TENSOR):
            dp = self.data_parallel(world_size)
            if dp > 1:
                head += f" {_TIMES} {'FSDP' if self.strategy == Strategy.TENSOR else 'DP'} {dp}"
        parts = [head, self.precision, f"mb {self.micro_batch_size} {_TIMES} accum {self.grad_accum_steps}"]
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return " · ".join(parts)
