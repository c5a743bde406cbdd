"""What a Hugging Face transformers model says about its activations: the inputs of the estimator's formula.

Korthikanti et al. 2022 count 16 values of s·b·h per transformer layer for GPT-3
(LayerNorm, a plain MLP of width 4h with a fused GELU, as many key/value heads as
query heads). A transformers model says where it differs, and `activation_shape`
reads it from the config and the modules:

- key/value heads (GQA, `num_key_value_heads`): K and V hold s·b·h·kv/a values each;
- the MLP width I (`intermediate_size`, GPT-2's `n_inner`, else 4h) and its kind: a
  gated MLP (SwiGLU: gate_proj, up_proj) keeps 4 values of s·b·I (gate output, its
  SiLU, up output, their product), a plain one 2 (first linear's output, the
  activation's output), and an activation written out in Python (GPT-2's `gelu_new`)
  5: its pow, tanh and products each keep a copy;
- norms: LayerNorm keeps its input (1 value of s·b·h); transformers' RMSNorm
  (x·rsqrt(mean x²), then the weight) its input and the normalised copy (2);
- outside the layers: norms before them (BERT's embedding LayerNorm, first pipeline
  stage); after them (last stage) the final norm, each per-token Linear's input and
  activation, and the fp32 log-softmax of s·b·V logits. A sequence classifier pools
  one token, so its head keeps next to nothing per position and has no vocabulary term;
- 16-bit training: RMSNorm's `x.float()` copy and a causal-LM loss's logits stay fp32; under torch
  autocast the residual stream (every norm value) is fp32, and each projection reading a layer's
  input (q, k, v; gate, up) casts its own 16-bit copy of it.

Torch-free: modules are read by duck typing.
"""

from __future__ import annotations

from typing import Any

from mpnb.planning.hf_plans import attention_heads, is_transformers_model

# activations transformers writes out in Python (several saved intermediates instead of one fused op)
PYTHON_ACTIVATIONS = {"gelu_new", "gelu_fast", "gelu_python", "gelu_accurate", "gelu_python_tanh",
                      "quick_gelu"}
GATED_MLP_NAMES = ("gate_proj", "gate_up_proj")
# separate projections reading the attention / MLP input: under autocast each casts its own 16-bit copy
ATTENTION_READERS = ("q_proj", "k_proj", "v_proj", "query", "key", "value")
MLP_READERS = ("gate_proj", "up_proj")
POOLED_HEADS = ("ForSequenceClassification", "ForMultipleChoice")


def _config_value(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _is_norm(module: Any) -> bool:
    return type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def _is_linear(module: Any) -> bool:
    # nn.Linear, and GPT-2's transformers Conv1D (a Linear with its weight transposed)
    return type(module).__name__ in ("Linear", "Conv1D") and hasattr(module, "weight")


def _is_activation(module: Any) -> bool:
    name = type(module).__name__
    return "GELU" in name or name in ("SiLUActivation", "SiLU", "ReLU", "Tanh")


def activation_shape(model: Any, blocks_name: str | None) -> dict[str, Any]:
    """Shape keys beyond Korthikanti's for a transformers model (empty for any other model).

    `blocks_name` is the dotted name of the repeated layers' container (`model_shape.find_blocks`).
    """
    if not is_transformers_model(model):
        return {}
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    hidden = _config_value(cfg, "hidden_size", "n_embd", "d_model")
    heads, kv_heads = attention_heads(model)
    intermediate = _config_value(cfg, "intermediate_size", "n_inner", "ffn_dim")
    if intermediate is None and hidden:
        intermediate = 4 * hidden  # GPT-2's n_inner=None
    names = [name for name, _ in model.named_modules()]
    gated = any(name.rsplit(".", 1)[-1] in GATED_MLP_NAMES for name in names)
    act = str(_config_value(cfg, "hidden_act", "activation_function") or "")
    rms = any(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    norm_values = 2 if rms else 1
    pooled = type(model).__name__.endswith(POOLED_HEADS)

    before, after, norms_before, norms_after = 0.0, 0.0, 0, 0
    position = "before"
    for name, module in model.named_modules():
        if blocks_name is not None and (name == blocks_name or name.startswith(blocks_name + ".")):
            position = "after"
            continue
        kept = norm_values if _is_norm(module) else 1 if (_is_linear(module) or _is_activation(module)) else 0
        if position == "before":
            before += kept if _is_norm(module) else 0  # embeddings keep no per-token input of their own
            norms_before += _is_norm(module)
        else:
            after += kept
            norms_after += _is_norm(module)
    mlp = "SwiGLU" if gated else f"{act or 'GELU'}"
    in_block = [name.rsplit(".", 1)[-1] for name in names if name.startswith(f"{blocks_name}.0.")]
    # a fused projection (GPT-2's c_attn, a plain MLP's first Linear) is one reader
    attn_readers = sum(n in ATTENTION_READERS for n in in_block) or 1
    mlp_readers = sum(n in MLP_READERS for n in in_block) or 1
    return {
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "mlp_values": 4 if gated else 5 if act in PYTHON_ACTIVATIONS else 2,
        "norm_values": norm_values,
        "embed_values": before,
        "head_values": 0.0 if pooled else after,
        "logits": not pooled,  # per-token logits over the vocabulary (a pooled classifier has none)
        # transformers' RMSNorm computes in fp32 (x.float()): one of its two values is fp32 in any precision
        "fp32_values": 2.0 if rms else 0.0,
        "head_fp32_values": float(norms_after) if rms else 0.0,
        # the causal-LM loss upcasts the logits (`logits.float()`); BERT's CrossEntropyLoss does not
        "logits_fp32": type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")),
        # torch autocast keeps the residual stream, so every norm value, in fp32, and each projection
        # reading the attention or MLP input casts its own 16-bit copy of it (2 are counted already)
        "autocast_fp32_values": 2.0 * norm_values,
        "autocast_outside_fp32": (float(norms_before * norm_values), float(norms_after * norm_values)),
        "input_copies": float(attn_readers + mlp_readers - 2),
        "arch": _describe(model, gated, rms, heads, kv_heads, mlp, intermediate, pooled),
    }


def _describe(model: Any, gated: bool, rms: bool, heads: Any, kv_heads: Any, mlp: str, width: Any,
              pooled: bool) -> str:
    kind = type(model).__name__
    style = "Llama-style decoder" if gated and rms else (
        "decoder" if kind.endswith(("ForCausalLM", "LMHeadModel")) else "encoder")
    attention = f"GQA {heads}/{kv_heads} heads" if kv_heads and kv_heads != heads else f"{heads} heads"
    head = "pooled classifier head" if pooled else "LM head"
    return (f"{kind}, {style}: {attention}, {mlp} MLP intermediate {width}, "
            f"{'RMSNorm' if rms else 'LayerNorm'}, {head}")
