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

A transformers model's config and modules say where it departs from GPT-3's layer
(GQA, gated or plain MLP of another width, RMSNorm, what sits outside the layers:
`mpnb.planning.hf_shape`); `layer_values` generalises the 16 values to them, and
`describe_formula` says what was used, with the model's numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpnb.planning.model_shape import even_stage_starts
from mpnb.planning.parallel_dims import ParallelDims, Strategy

if TYPE_CHECKING:
    from mpnb.planning.layout import Layout
    from mpnb.planning.settings import Settings

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


AUTOCAST_NOTE = (
    "torch autocast (ddp, pipeline, tensor without data parallelism, in 16 bits) also keeps a 16-bit copy "
    "of each Linear weight for backward, not counted in activations"
)


def uses_autocast(cfg: Settings, dims: ParallelDims) -> bool:
    """The strategy computes in 16 bits with torch.autocast (FSDP2 and DeepSpeed cast the module instead)."""
    if cfg.strategy == Strategy.TENSOR:
        return dims.dp == 1  # with data parallelism FSDP2's MixedPrecisionPolicy casts
    return cfg.strategy in (Strategy.DDP, Strategy.PIPELINE)


def layer_values(layout: Layout) -> tuple[float, float]:
    """Values of s·b·h one layer keeps: (replicated under tensor parallelism, split by it).

    Korthikanti's 16 = 4 + 12: the two LayerNorm inputs and the attention and MLP inputs are
    replicated; Q, K, V, the attention output and the two MLP intermediates (4h wide) are split.
    GQA shrinks K and V to kv/a of h, the MLP keeps `mlp_values` tensors of its width, and an
    RMSNorm keeps two values where a LayerNorm keeps one (`hf_shape`).
    """
    h = layout.hidden or 1
    a = layout.heads or 1
    kv = (layout.kv_heads or a) / a
    width = (layout.intermediate or 4 * h) / h
    replicated = 2 * layout.norm_values + 2
    split = 1 + 2 * kv + 1 + layout.mlp_values * width
    return replicated, split


def describe_formula(cfg: Settings, layout: Layout, mb: int) -> str:
    """Which formula the activations follow, with this model's numbers; "" when the shape is unknown."""
    if layout.n_layer is None or layout.hidden is None or layout.seq_len is None:
        return ""
    replicated, split = layer_values(layout)
    nbytes = COMPUTE_BYTES[cfg.precision]
    scores = "" if layout.flash else f" + {'2' if layout.dropout else '1'}·a·s²·b score values"
    masks = " + 2·s·b·h one-byte dropout masks" if layout.dropout else ""
    what = layout.arch or "GPT-style transformer"
    outside = []
    if layout.embed_values:
        outside.append(f"{layout.embed_values:g}·s·b·h before the layers")
    if layout.head_values:
        outside.append(f"{layout.head_values:g}·s·b·h after them")
    if layout.vocab and layout.logits:
        outside.append(f"fp32 log-softmax of s·b·V logits (V = {layout.vocab})")
    return (f"{what}; {layout.n_layer} layers x s·b·h·{replicated + split:g} values ({nbytes} bytes each, "
            f"{split:g} of them split by tensor parallelism){scores}{masks}"
            + (f", plus {', '.join(outside)}" if outside else "")
            + f"; s = {layout.seq_len}, b = {mb}, h = {layout.hidden}. After Korthikanti et al. 2022")


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
        first, last = stage == 0, stage == pp - 1
    else:
        b, layers, in_flight, first, last = mb, layout.n_layer, 1, True, True

    sbh = s * b * h
    scores = 0 if layout.flash else a * s * s * b
    replicated, split = layer_values(layout)
    autocast = nbytes < 4 and uses_autocast(cfg, dims)
    fp32 = layout.autocast_fp32_values if autocast else layout.fp32_values  # counted at nbytes, topped up
    values = nbytes * (replicated * sbh + split * sbh / t) + (4 - nbytes) * fp32 * sbh
    if autocast:
        values += nbytes * layout.input_copies * sbh
    score_values = (2 if layout.dropout else 1) * nbytes * scores / t
    masks = (2 * sbh + scores / t) if layout.dropout else 0
    full_layer = values + score_values + masks
    if cfg.activation_checkpointing:
        per_microbatch = layers * nbytes * sbh + full_layer  # layer inputs + the layer being recomputed
    else:
        per_microbatch = layers * full_layer
    # outside the layers (never checkpointed): the embedding norm on the first stage, final norm and head
    # on the last
    outside = (layout.embed_values if first else 0) + (layout.head_values if last else 0)
    before, after = layout.autocast_outside_fp32 if autocast else (0, layout.head_fp32_values)
    outside_fp32 = (before if first else 0) + (after if last else 0)
    per_microbatch += nbytes * sbh * outside + (4 - nbytes) * sbh * outside_fp32
    total = per_microbatch * in_flight
    if last and layout.vocab and layout.logits:  # the log-softmax of the logits, for the loss
        total += (4 if layout.logits_fp32 or autocast else nbytes) * s * b * layout.vocab * in_flight
    return int(total)
