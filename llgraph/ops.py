"""The closed op set. ONE schema per op: inputs (a trailing '?' marks optional), outputs, typed attributes, and the
shape/dtype rule (its `infer`, in llgraph/op_shapes.py). Every backend registers an implementation per op against
these names (the torch executor's TORCH_IMPLS, each ONNX target's lowerings; tests/core/test_ir.py lists ops x
backends and fails on a hole), and the TensorRT plugin fields are read from `attrs` here.

Layouts: activations are [batch, seq, features]; heads stay packed in the feature axis ([B, S, H*D]) the way ONNX
Runtime's GroupQueryAttention and ONNX's RotaryEmbedding/Attention take them. Linear weights are [out, in].
The KV cache is [rows, kv_heads, max_seq, row] (row: head_dim values in one of llgraph/kv_cache.py's formats):
token (b, s) lives in cache row b, or with GroupedAttention's `slots` input in row slots[b * S + s] (ragged
batches: only the busy rows run, tokens of several rows packed in any order); it is written at position
`positions[b, s]` and its query sees that row's positions 0..positions[b, s] (causal) — no attention mask input is
needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llgraph.op_shapes as shapes
from llgraph.op_shapes import EXPERT_FORMATS, SUPERBLOCK_BYTES


@dataclass(frozen=True)
class Attr:
    name: str
    type: type  # int, float, str, bool, or tuple (of ints)
    doc: str = ""
    choices: tuple = ()


@dataclass(frozen=True)
class OpSchema:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # ("*",): as many as the node names
    attrs: tuple[Attr, ...]
    infer: Callable[[Sequence[Any], Mapping[str, Any]], list[tuple[str, tuple]]]
    doc: str


def check_attrs(schema: OpSchema, attrs: Mapping[str, Any]) -> None:
    names = {a.name for a in schema.attrs}
    if set(attrs) != names:
        missing, extra = sorted(names - set(attrs)), sorted(set(attrs) - names)
        raise ValueError(f"attributes missing {missing} / unexpected {extra}")
    for a in schema.attrs:
        v = attrs[a.name]
        ok = isinstance(v, a.type) and not (a.type is int and isinstance(v, bool))
        if a.type is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if a.type is tuple:
            ok = isinstance(v, tuple) and all(isinstance(x, int) for x in v)
        if not ok:
            raise ValueError(f"attribute {a.name}={v!r} must be {a.type.__name__}")
        if a.choices and v not in a.choices:
            raise ValueError(f"attribute {a.name}={v!r} must be one of {a.choices}")


QUANT_ATTRS = (  # the blocked format (llgraph/quant.py) of QLinear's and QEmbedding's codes
    Attr("format", str, "blocks: codes + scales (+ mins); Q2_K..Q6_K/IQ4_XS/IQ4_NL/MXFP4: GGUF blocks as stored",
         ("blocks", *SUPERBLOCK_BYTES)),
    Attr("bits", int, "code width (blocks: 4 or 8; super-blocks: 2 to 6)", (2, 3, 4, 5, 6, 8)),
    Attr("block_size", int, "codes per scale along the input features (super-blocks: 256)"),
    Attr("zero_point", int, "the code that means 0 (before mins)"),
    # (the ort export on llgraph's kernels writes blocks of 5-bit codes packed at 5 bits: a layout of that lowering,
    # export/ort_qlinear.py, like its 16-row interleaving; the IR holds them in 8)
    Attr("code_bits", int, "bits the codes use, <= bits (5 for GGUF Q5_0/Q5_1/Q5_K, 6 for Q6_K held in 8)"),
    Attr("exponent", int, "w is 2^exponent times what super-blocks say (IQ3_XXS carried as Q6_K: -1; else 0)"),
)

# a mixture's inputs and routing, which MoE and QMoE (its experts in GGUF super-blocks) share
MOE_INPUTS = ("x", "router", "gate", "up", "down", "shared_gate?", "shared_up?", "shared_down?", "shared_router?",
              "router_bias?", "gate_bias?", "up_bias?", "down_bias?")
ROUTING = (
    Attr("top_k", int, "experts each token takes"),
    Attr("normalize", bool, "the k weights rescaled to sum to 1 (Qwen3-MoE's norm_topk_prob, Mixtral; gpt-oss's "
                            "softmax over the k chosen logits is the same)"),
    # the experts' gated activation: SwiGLU at alpha 1, beta 0, limit 0; gpt-oss's clamped one at 1.702, 1, 7
    Attr("alpha", float, "act = g * sigmoid(alpha * g) * (u + beta)"),
    Attr("beta", float, "added to up before the product"),
    Attr("limit", float, "g clamped to <= limit and u to [-limit, limit] first; 0: no clamp"),
)

SCHEMAS: dict[str, OpSchema] = {s.name: s for s in (
    OpSchema("Embedding", ("ids", "table"), ("out",), (
        Attr("scale", float, "multiplies the rows, in the table's dtype (Gemma: sqrt(hidden); else 1)"),
    ), shapes.embedding, "table[ids] * scale"),
    OpSchema("RMSNorm", ("x", "weight"), ("out",), (
        Attr("eps", float),
        Attr("group", int, "features normalized together: the last dim, or a head's (QK-norm per head)"),
    ), shapes.rmsnorm, "each consecutive `group` features of the last axis: x / sqrt(mean(x^2) + eps) * weight, "
                 "computed in float32"),
    OpSchema("Linear", ("x", "weight", "bias?"), ("out",), (), shapes.linear, "x @ weight^T + bias"),
    OpSchema("QLinear", ("x", "codes", "scales?", "mins?", "bias?"), ("out",), QUANT_ATTRS, shapes.qlinear,
             "x @ w^T + bias with w[o, b*B + j] = scales[o, b] * (q[o, b, j] - zero_point) + mins[o, b]; "
             "q unpacked from codes (4-bit: two per byte, low nibble first); or, a super-block format, w as "
             "ggml defines those super-blocks (codes [out, in/256, bytes], no scales or mins); see llgraph/quant.py"),
    OpSchema("QEmbedding", ("ids", "codes", "scales?", "mins?"), ("out",), (
        *QUANT_ATTRS, Attr("scale", float, "multiplies the rows, as Embedding's"),
    ), shapes.qembedding, "Embedding over a blocked table in QLinear's format (a GGUF's token_embd as stored; tied "
                          "to a QLinear lm head, the same codes): the rows ids, dequantized, * scale"),
    OpSchema("Split", ("x",), ("*",), (Attr("sizes", tuple, "sizes along the last axis"),),
             shapes.split, "split the last axis into consecutive pieces"),
    OpSchema("RotaryCosSin", ("positions", "inv_freq"), ("cos", "sin"), (
        Attr("scaling", float, "multiplies cos and sin (YaRN's attention factor)"),
        Attr("dynamic_factor", float, "dynamic NTK factor; 0 disables"),
        Attr("original_max_position", int, "dynamic NTK: positions past this stretch the base"),
    ), shapes.rotary_cos_sin,
        "angles = positions * inv_freq (float32); with dynamic NTK, inv_freq is recomputed for "
        "L = max(positions) + 1 > original_max_position: inv_freq * r^(-2i/(d-2)), r = factor*L/orig - (factor-1)"),
    OpSchema("Rotary", ("x", "cos", "sin"), ("out",), (
        Attr("num_heads", int),
        Attr("interleaved", bool, "pairs (2i, 2i+1) as Meta/GGUF; else (i, i + r/2) as HF"),
    ), shapes.rotary, "rotate the first 2*cos.shape[-1] dims of each head; the rest pass through"),
    OpSchema("GroupedAttention", ("q", "k", "v", "positions", "past_key", "past_value", "slots?", "sinks?"),
             ("out", "present_key", "present_value"), (
        Attr("num_heads", int), Attr("num_kv_heads", int), Attr("scale", float), Attr("causal", bool),
        Attr("window", int, "sliding window: a query sees the slots of the last `window` positions (0: all)"),
        Attr("softcap", float, "logits (after scale) become softcap * tanh(logits / softcap); 0: none (Gemma 2)"),
    ), shapes.attention,
        "write every token's k, v into its cache row (b; with `slots` [B*S] int64, slots[b*S + s], an empty "
        "tensor meaning b) at position positions[b, s] (in the cache's format, llgraph/kv_cache.py: q's dtype, "
        "float16, or int8 rows of D codes and a float32 scale), all of the step's before any query reads; attend "
        "query (b, s) to its row's positions 0..positions[b, s] (causal) or 0..max(positions[b]) (non-causal); "
        "position p lives in slot p mod T of a cache of T slots: T > every position, or, with a window, a ring of "
        "T >= window + (the row's span of positions in the step) - 1 slots (llgraph/kv_cache.py ring_length); kv "
        "head j serves query heads j*g..(j+1)*g-1 with g = num_heads / num_kv_heads. With `sinks` [num_heads] "
        "(gpt-oss), head h's softmax denominator also holds exp(sinks[h]): a logit no value stands behind"),
    OpSchema("SwiGLU", ("gate", "up"), ("out",), (), shapes.swiglu, "silu(gate) * up"),
    OpSchema("MoE", MOE_INPUTS, ("out",), ROUTING, shapes.moe,
        "routed experts: p = softmax(x @ router^T + router_bias) over all experts (float32), the top_k of p (ties: "
        "the lower expert), w = those p (/ their sum if normalize); out = sum over the chosen e of w_e * (act(x @ "
        "gate[e]^T + gate_bias[e], x @ up[e]^T + up_bias[e]) @ down[e]^T + down_bias[e]), act as alpha, beta and "
        "limit say (silu(g) * u by default). gate, up: [experts, ffn, hidden]; down: [experts, hidden, ffn]; absent "
        "biases 0. With a shared "
        "expert (Qwen2-MoE), out += sigmoid(x @ shared_router^T) * (silu(x @ shared_gate^T) * (x @ shared_up^T)) "
        "@ shared_down^T"),
    OpSchema("QMoE", MOE_INPUTS, ("out",), (
        *ROUTING,
        Attr("format", str, "gate's and up's GGUF super-blocks", EXPERT_FORMATS),
        Attr("down_format", str, "down's GGUF super-blocks", EXPERT_FORMATS),
        Attr("exponent", int, "gate and up are 2^exponent times what their super-blocks say (QLinear's)"),
        Attr("down_exponent", int, "down is 2^down_exponent times what its super-blocks say"),
    ), shapes.qmoe,
        "MoE with its routed experts as a GGUF stores them: gate, up [experts, ffn, hidden/P, bytes] and down "
        "[experts, hidden, ffn/P, bytes], each expert's rows QLinear's super-blocks (format, down_format; P their "
        "weights a block, 256 or 32), w as "
        "ggml dequantizes them; router and the shared expert float, as MoE's"),
    OpSchema("ExpertMatMul", ("x", "weight", "chosen", "order?", "blocks?"), ("out",), (),
        shapes.expert_matmul,
        "out[t, i] = x[t, i] @ weight[chosen[t, i]] (x[t, 0] where x has one row a token): each token's rows "
        "through its chosen experts' matrices, ggml's mul_mat_id. x [tokens, 1 or k, in]; weight [experts, in, out], "
        "as MatMul takes them; chosen [tokens, k] int64 -> [tokens, k, out]. order and blocks (int64, 1-D) are "
        "the pairs grouped by expert in runs, as a kernel takes them (export/expert_schedule.py: the `trt` lowering "
        "derives them from chosen); the result is chosen's alone. What a MoE's gathered way lowers to "
        "(export/onnx_moe.py): TensorRT's plugin reads each chosen expert's matrix once for all the rows that chose "
        "it"),
    OpSchema("GeGLU", ("gate", "up"), ("out",), (), shapes.swiglu, "gelu_tanh(gate) * up (Gemma's MLP)"),
    OpSchema("SoftCap", ("x",), ("out",), (Attr("cap", float),), shapes.softcap,
             "cap * tanh(x / cap) (Gemma 2's final logits)"),
    OpSchema("KeepLast", ("x", "keep"), ("out",), (), shapes.keep_last,
             "x[:, -keep:] (the last `keep` positions; all when keep is 0 or >= seq): the ort target's logits "
             "for the positions a step samples from, not the whole prompt (llgraph/passes.keep_last_positions)"),
    OpSchema("Add", ("a", "b"), ("out",), (), shapes.add, "a + b"),
)}
