"""Bytes each rank hands to collectives per optimizer step, by kind, before anything runs.

The same units as `mpnb.engine.comm_count` measures: the tensor given to the
op (an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's
full input). With Ψ parameters and data parallelism (the ZeRO paper, §7):

- DDP and ZeRO-0: all-reduce of the gradients, Ψ·G (in the paper's units 2Ψ).
- FSDP: all-gather of the parameters before forward and again before backward
  (reshard_after_forward), 2Ψ·c, and a reduce-scatter of the gradients, Ψ·G: 3Ψ.
- ZeRO-1/2 as DeepSpeed runs them: the gradient buckets are all-reduced (its
  `use_multi_rank_bucket_allreduce` path), Ψ·G, then each rank's updated
  partition is all-gathered, Ψ·P: 3Ψ, where the paper's reduce-scatter gives 2Ψ.
- ZeRO-3 as DeepSpeed runs it: parameters gathered in forward stay gathered for
  backward while they fit `stage3_max_reuse_distance` (1e9 elements by default),
  so one all-gather Ψ·P plus the reduce-scatter Ψ·G: 2Ψ; larger models gather
  twice: the paper's 3Ψ.
- Tensor parallelism (Megatron, Shoeybi et al. 2019): per layer two all-reduces
  of the b·s·h activations in forward (after attention and after the MLP) and two
  of their gradients in backward.
- Pipeline: per micro-batch, a stage sends its b·s·h output forward and the
  gradient of its input backward; the first and last stages each do one of
  those, middle stages both.
"""

from __future__ import annotations

from collections.abc import Callable

from mpnb.planning.activations import COMPUTE_BYTES
from mpnb.planning.config import Config
from mpnb.planning.layout import Layout
from mpnb.planning.parallel_dims import ParallelDims, Strategy

ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default (elements)


def comm_bytes_per_step(cfg: Config, dims: ParallelDims, layout: Layout, micro_batch_size: int,
                        bytes_per_param: tuple[float, float, float]) -> dict[str, int]:
    """{kind: bytes} the busiest rank hands to collectives per step; {} with one rank."""
    p_bytes, g_bytes, _ = bytes_per_param
    compute = COMPUTE_BYTES[cfg.precision]
    accum = cfg.grad_accum_steps
    rows = micro_batch_size * accum  # rows this rank runs per step, through its micro-batches
    out: dict[str, float] = {}

    def add(kind: str, value: float) -> None:
        out[kind] = out.get(kind, 0) + value

    activation = _activation_values(layout, rows)
    if cfg.strategy == Strategy.TENSOR and dims.tp > 1 and activation and layout.n_layer:
        add("all_reduce", 4 * layout.n_layer * activation * compute)
    if cfg.strategy == Strategy.PIPELINE and dims.pp > 1 and activation:
        add("send", activation * compute * (2 if dims.pp > 2 else 1))
        add("recv", activation * compute * (2 if dims.pp > 2 else 1))
    if dims.dp > 1:
        local = layout.total / (dims.tp * dims.pp)  # what data parallelism keeps in step (approximately)
        _data_parallel(cfg, local, p_bytes, g_bytes, compute, accum, add)
    return {kind: int(value) for kind, value in sorted(out.items())}


def _data_parallel(cfg: Config, psi: float, p_bytes: float, g_bytes: float, compute: int, accum: int,
                   add: Callable[[str, float], None]) -> None:
    if cfg.strategy == Strategy.ZERO:
        stage = cfg.zero_stage
        if stage == 3:
            gathers = 1 if psi <= ZERO3_MAX_REUSE_DISTANCE else 2
            add("all_gather", gathers * accum * psi * p_bytes)
            add("reduce_scatter", psi * g_bytes)
        else:
            add("all_reduce", psi * g_bytes)
            if stage in (1, 2):
                add("all_gather", psi * p_bytes)
    elif cfg.strategy in (Strategy.FSDP, Strategy.TENSOR, Strategy.PIPELINE):  # FSDP2 over the dp ranks
        gathers = 2 if cfg.reshard_after_forward else 1
        add("all_gather", gathers * accum * psi * compute)
        add("reduce_scatter", psi * g_bytes)
    else:  # DDP: gradients all-reduced once per step (no_sync on the other micro-batches)
        add("all_reduce", psi * g_bytes)


def _activation_values(layout: Layout, rows: int) -> int:
    """b·s·h of one step's rows, or 0 when the model's shape is unknown."""
    if not (layout.seq_len and layout.hidden):
        return 0
    return rows * layout.seq_len * layout.hidden


def volume(comm: dict[str, float]) -> float:
    """Bytes in the ZeRO paper's units: an all-reduce counts twice (reduce-scatter + all-gather)."""
    return sum(b * (2 if kind == "all_reduce" else 1) for kind, b in comm.items())
