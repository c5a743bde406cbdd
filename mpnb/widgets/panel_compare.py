"""The config panel's "Compare strategies" tab: the ZeRO paper's Figure 1 for the form's model, then the rest.

The paper (Rajbhandari et al. 2020, Figure 1) compares *model states*:
parameters, gradients and optimizer state. Those shrink stage by stage. A real
rank also holds activations and framework buffers, above all DeepSpeed's
gradient reduction bucket (`reduce_bucket_size` elements, allocated whole), which
on a small model outweighs what ZeRO saves. Drawn together the bars contradict
the paper, so the tab draws them apart: model states first, next to the
paper's own example recomputed by `mpnb.estimate`; then activations and buffers
with what sets them; then the total against the memory per rank.

Rows carry `data-states`, `data-other` or `data-strategy` (the strategy name)
and `data-total` (bytes of what that bar draws).
"""

from __future__ import annotations

import html

from mpnb.planning.activations import COMPUTE_BYTES
from mpnb.planning.config import Config
from mpnb.planning.estimator import DEFAULT_REDUCE_BUCKET, Estimate, estimate
from mpnb.units import format_bytes
from mpnb.widgets.bars import MODEL_STATES, OTHER, bar, legend

# the paper's Figure 1: Ψ = 7.5 B parameters, N_d = 64 GPUs, mixed-precision Adam (K = 12); decimal GB
PAPER_PSI = 7_500_000_000
PAPER_GPUS = 64
PAPER_GB = {"DDP": 120.0, "ZeRO-1": 31.4, "ZeRO-2": 16.6, "ZeRO-3": 1.9}
PAPER_CONFIGS = {"DDP": {"strategy": "ddp"}, **{f"ZeRO-{s}": {"strategy": "zero", "zero_stage": s}
                                                for s in (1, 2, 3)}}
DEFAULT_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size default (elements)

P_STYLE = 'style="font-size:12px;margin:4px 0"'
NOTE_STYLE = 'style="color:#555;font-size:11px;margin:2px 0"'


def paper_example() -> dict[str, int]:
    """Model-state bytes per GPU for the paper's example, from `mpnb.estimate` with the paper's accounting."""
    return {name: estimate(PAPER_PSI, Config(**kw), PAPER_GPUS, accounting="paper").model_states
            for name, kw in PAPER_CONFIGS.items()}


def paper_html() -> str:
    """The paper's Figure 1 numbers next to the estimator's, in the paper's decimal GB and in GiB."""
    ours = paper_example()
    cell = "<td style='padding:0 6px;white-space:nowrap'{}>{}</td>"
    head = "".join(f"<th style='padding:0 6px;white-space:nowrap'>{name}</th>" for name in PAPER_GB)
    paper = "".join(cell.format("", f"{gb:g} GB") for gb in PAPER_GB.values())
    est_gb = "".join(cell.format(f" data-bytes='{b}'", f"{b / 1e9:.1f} GB") for b in ours.values())
    est_gib = "".join(cell.format("", format_bytes(b)) for b in ours.values())
    call = "mpnb.estimate(7.5e9, config, 64, accounting=&quot;paper&quot;)"
    return (
        '<div class="mpnb-panel-paper" style="font-size:12px;margin:6px 0;line-height:1.45">'
        "<b>Check: the paper's own example.</b> &Psi; = 7.5 B parameters on N<sub>d</sub> = 64 GPUs with "
        "mixed-precision Adam (2 + 2 + 12 bytes per parameter). The paper writes decimal GB "
        "(10<sup>9</sup> bytes); mpnb shows GiB (2<sup>30</sup> bytes) everywhere else."
        f"<table style='font-size:12px;margin-top:2px'><tr><th></th>{head}</tr>"
        f"<tr><td>paper, Figure 1</td>{paper}</tr>"
        f"<tr><td title='{call}'>mpnb.estimate</td>{est_gb}</tr>"
        f"<tr><td>the same in GiB</td>{est_gib}</tr></table></div>"
    )


def _elements(n: int) -> str:
    """5e8 as DeepSpeed's docs write it (not 5e+08)."""
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


def _buffer_note(name: str, est: Estimate, precision: str) -> str:
    """What the framework buffers of one strategy are and which setting changes them."""
    nbytes = COMPUTE_BYTES[precision]
    bucket_setting = (f"<code>reduce_bucket_size</code> elements &times; {nbytes} bytes (DeepSpeed's default "
                      f"is {_elements(DEFAULT_REDUCE_BUCKET)}; mpnb caps it at the model's parameter count)")
    if name == "DDP":
        return "DDP: no extra buffers (mpnb's DDP uses the gradients as its communication buckets)."
    if name in ("ZeRO-1", "ZeRO-2"):
        return (f"{name}: DeepSpeed's gradient reduction bucket, {format_bytes(est.worst.buffers)}: "
                f"{bucket_setting}, allocated whole in every backward.")
    if name == "ZeRO-3":
        return (f"ZeRO-3: the same reduction bucket ({bucket_setting}, kept from the start), plus the "
                "parameters gathered for the layer being computed (<code>stage3_prefetch_bucket_size</code>, "
                f"{_elements(DEFAULT_PREFETCH_BUCKET)} elements, and <code>stage3_max_live_parameters</code> "
                "bound how many are gathered ahead).")
    return (f"{name}: the unsharded parameters of the current and the next FSDP unit (a block) and one "
            f"unit's gradients, {format_bytes(est.buffers)}; <code>reshard_after_forward=False</code> "
            "keeps a whole model's worth instead.")


def compare_html(rows: list[tuple[str, Estimate | str]], capacity: int, precision: str) -> str:
    """Model states, then activations and buffers, then totals: one bar per strategy's most loaded rank."""
    ok = [(name, est) for name, est in rows if isinstance(est, Estimate)]
    out = ['<div class="mpnb-panel-compare-bars" style="line-height:1.45">']

    out.append(f"<div {P_STYLE}><b>1 · Model states per rank</b> (parameters, gradients, optimizer state) "
               "of the most loaded rank: the ZeRO paper's Figure 1 for your model. ZeRO-1 shards the "
               "optimizer state over the data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 and FSDP "
               "the parameters too.</div>")
    out.append(legend(MODEL_STATES))
    scale = max([est.worst.model_states for _, est in ok] + [1])
    out.extend(bar(name, est.worst, scale, 0, kind="states", keys=MODEL_STATES) for name, est in ok)
    for name, est in rows:
        if not isinstance(est, Estimate):
            out.append(f'<div class="mpnb-panel-row mpnb-panel-unavailable" '
                       f'data-states="{html.escape(name)}" style="font-size:12px;color:#777;margin:3px 0">'
                       f"{html.escape(name)}: "
                       f"{html.escape(est)}</div>")
    states = dict((name, est.model_states) for name, est in ok)
    if states.get("ZeRO-1", 0) > states.get("DDP", 2**63):
        out.append(f"<div {NOTE_STYLE}>ZeRO-1 holds more than DDP here: DeepSpeed keeps an fp32 master copy "
                   "of the parameters (4 more bytes each) that torch's AdamW under DDP does not, and with "
                   "this few ranks sharding the optimizer state saves less than that.</div>")
    out.append(paper_html())

    out.append(f"<div {P_STYLE}><b>2 · Activations and framework buffers</b>, which the paper's figure "
               "leaves out. Activations are what autograd saves for backward: the same under every "
               "data-parallel strategy; a smaller micro batch or activation checkpointing shrinks them."
               "</div>")
    out.append(legend(OTHER))
    scale = max([est.worst.activations + est.worst.buffers for _, est in ok] + [1])
    out.extend(bar(name, est.worst, scale, 0, kind="other", keys=OTHER) for name, est in ok)
    notes = "".join(f"<li>{_buffer_note(name, est, precision)}</li>" for name, est in ok)
    out.append(f'<ul class="mpnb-panel-buffer-notes" {NOTE_STYLE[:-1]};padding-left:16px">{notes}</ul>')
    out.append(f"<div {NOTE_STYLE}>To shrink DeepSpeed's buckets set a smaller "
               "<code>reduce_bucket_size</code> (and at ZeRO-3 <code>stage3_prefetch_bucket_size</code>) "
               "under <code>zero_optimization</code> "
               "in the ds_config, e.g. 5e7; <code>mpnb.estimate(model, config, world_size, "
               "reduce_bucket_size=5e7)</code> shows the effect.</div>")

    out.append(f"<div {P_STYLE}><b>3 · Everything per rank</b> against the memory per rank.</div>")
    out.append(legend(capacity=capacity > 0))
    scale = max([capacity * 1.05] + [est.total for _, est in ok] + [1])
    out.extend(bar(name, est.worst, scale, capacity, kind="strategy") for name, est in ok)
    out.append("</div>")
    return "".join(out)
