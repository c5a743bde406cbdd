"""Activation bytes of one rank, after Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models": per
transformer layer, in 16-bit, s·b·h·(34 + 5·a·s/h) bytes, of which 32·sbh are
2-byte tensors (16 values of s·b·h), 2·sbh one-byte dropout masks, and
5·a·s²·b the attention scores (2 + 2 bytes softmax and dropout output, 1 byte
mask). In fp32 the 2-byte tensors double and the masks do not:
s·b·h·(66 + 9·a·s/h). Without dropout the masks and the dropout output go;
with fused attention (flash / SDPA) the a·s² terms go. Tensor parallelism
without sequence parallelism divides 12 of the 16 values and the scores by t:
s·b·h·(10 + 24/t + 5·a·s/(h·t)) in 16-bit. Full activation checkpointing keeps
each layer's input (s·b·h values) plus one layer's full activations while it
is recomputed. Pipelines keep several microbatches in flight: GPipe all m,
1F1B at most pp - stage on stage `stage`. The last stage also holds the fp32
log-softmax of the logits (4·s·b·V).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpnb.planning.model_shape import even_stage_starts
from mpnb.planning.parallel_dims import ParallelDims, Strategy

if TYPE_CHECKING:
    from mpnb.planning.layout import Layout
    from mpnb.planning.settings import Settings

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def activation_bytes(cfg: Settings, dims: ParallelDims, layout: Layout, mb: int, stage: int) -> int:
    """Activation bytes on pipeline stage `stage` for a micro-batch of `mb`; 0 when the shape is unknown."""
    if layout.n_layer is None or layout.hidden is None or layout.seq_len is None:
        return 0
    s, h = layout.seq_len, layout.hidden
    a = layout.heads or 1
    pp = dims.pp
    t = dims.tp if cfg.strategy == Strategy.TENSOR else 1
    nbytes = COMPUTE_BYTES[cfg.precision]

    if cfg.strategy == Strategy.PIPELINE:
        b = mb // cfg.microbatches
        starts = [*even_stage_starts(layout.n_layer, pp), layout.n_layer]
        layers = starts[stage + 1] - starts[stage]
        gpipe = cfg.pipeline_schedule == "gpipe"
        in_flight = cfg.microbatches if gpipe else min(pp - stage, cfg.microbatches)
        last = stage == pp - 1
    else:
        b, layers, in_flight, last = mb, layout.n_layer, 1, True

    sbh = s * b * h
    scores = 0 if layout.flash else a * s * s * b
    # 16 values of s*b*h per layer: 4 replicated (layer norm inputs, attention and MLP inputs), 12 split by t
    values = nbytes * (4 * sbh + 12 * sbh / t)
    score_values = (2 if layout.dropout else 1) * nbytes * scores / t
    masks = (2 * sbh + scores / t) if layout.dropout else 0
    full_layer = values + score_values + masks
    if cfg.activation_checkpointing:
        per_microbatch = layers * nbytes * sbh + full_layer  # layer inputs + the layer being recomputed
    else:
        per_microbatch = layers * full_layer
    total = per_microbatch * in_flight
    if last and layout.vocab:
        total += 4 * s * b * layout.vocab * in_flight  # fp32 log-softmax of the logits for the loss
    return int(total)
