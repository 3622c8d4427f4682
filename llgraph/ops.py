"""The closed op set. ONE schema per op: inputs (a trailing '?' marks optional), outputs, typed attributes, and the
shape/dtype rule. Every backend registers an implementation per op against these names (the torch executor's
TORCH_IMPLS, each ONNX target's lowerings; tests/core/test_ir.py lists ops x backends and fails on a hole), and
the TensorRT plugin fields are read from `attrs` here.

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
from types import SimpleNamespace
from typing import Any

from llgraph.kv_cache import FORMATS, of_dtype

FLOATS = ("float32", "float16", "bfloat16", "float64")
INTS = ("int64", "int32")


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


def _require(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


def _float(v, what):
    _require(v.dtype in FLOATS, f"{what} must be a float tensor, got {v.dtype}")


def _same(a, b, what):
    _require(a == b, f"{what}: {a} != {b}")


# -- shape/dtype rules ----------------------------------------------------------------------------------------------

def _embedding(ins, attrs):
    ids, table = ins
    _require(ids.dtype in INTS, f"ids must be integer, got {ids.dtype}")
    _require(len(table.shape) == 2, f"table must be 2-D, got {table.shape}")
    return [(table.dtype, ids.shape + (table.shape[1],))]


def _rmsnorm(ins, attrs):
    x, w = ins
    _float(x, "x")
    g = attrs["group"]
    _require(g > 0 and x.shape[-1] % g == 0, f"group ({g}) must divide x's last dim ({x.shape[-1]})")
    _same(w.shape, (g,), "weight shape vs group")
    return [(x.dtype, x.shape)]


def _linear(ins, attrs):
    x, w, b = ins
    _float(x, "x")
    _require(len(w.shape) == 2, f"weight must be [out, in], got {w.shape}")
    _same(w.shape[1], x.shape[-1], "weight in-features vs x's last dim")
    _same(w.dtype, x.dtype, "weight dtype vs x dtype")
    if b is not None:
        _same(b.shape, (w.shape[0],), "bias shape vs out-features")
    return [(x.dtype, x.shape[:-1] + (w.shape[0],))]


# (quant.py's) GGUF bytes per 256 weights, by super-block format
SUPERBLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136, "Q3_K": 110, "Q2_K": 84, "IQ4_NL": 18,
                    "MXFP4": 17}
# weights a block where not 256: IQ4_NL (IQ4_XS's fallback) and MXFP4 (gpt-oss's experts), blocks of 32
SUPERBLOCK_WEIGHTS = {"IQ4_NL": 32, "MXFP4": 32}
EXPERT_FORMATS = tuple(SUPERBLOCK_BYTES)  # QMoE's: every one


def superblock_weights(fmt: str) -> int:
    """The weights in one block of a super-block format (256, or IQ4_NL's and MXFP4's 32)."""
    return SUPERBLOCK_WEIGHTS.get(fmt, 256)


def _blocks(codes, scales, mins, attrs, dtype):
    """The codes (and scales, mins) of the blocked format `attrs` names: shapes and dtypes -> the features."""
    fmt, bits, block = attrs["format"], attrs["bits"], attrs["block_size"]
    _require(codes.dtype == "uint8" and len(codes.shape) == 3, f"codes must be uint8 [out, in/block, packed], got "
             f"{codes.dtype}{list(codes.shape)}")
    if fmt != "blocks":  # GGUF super-blocks as stored: they hold their scales and mins
        _same(block, superblock_weights(fmt), f"{fmt} block_size (weights a block)")
        _same(codes.shape[2], SUPERBLOCK_BYTES[fmt], f"{fmt} bytes per super-block")
        _require(scales is None and mins is None, f"{fmt} super-blocks take no scales or mins inputs")
        return codes.shape[1] * block
    _require(bits in (4, 8), f"the blocked format's codes are 4 or 8 bits, not {bits}")
    _same(codes.shape[2], block * bits // 8, "packed bytes per block vs block_size * bits / 8")
    _require(scales is not None, "the blocked format needs its scales")
    _same(scales.shape, codes.shape[:2], "scales shape vs codes' [out, blocks]")
    _same(scales.dtype, dtype, "scales dtype vs x dtype")
    if mins is not None:
        _same(mins.shape, scales.shape, "mins shape vs scales")
        _same(mins.dtype, dtype, "mins dtype vs scales dtype")
    return codes.shape[1] * block


def _exponent(attrs, name="exponent"):
    _require(attrs[name] == 0 or (attrs.get("format", "Q") != "blocks" and -8 <= attrs[name] <= 8),
             f"{name} ({attrs[name]}) must be 0, or within -8..8 on super-blocks")


def _qlinear(ins, attrs):
    _exponent(attrs)
    x, codes, scales, mins, b = ins
    _float(x, "x")
    _same(_blocks(codes, scales, mins, attrs, x.dtype), x.shape[-1], "the codes' input features vs x's last dim")
    if b is not None:
        _same(b.shape, (codes.shape[0],), "bias shape vs out-features")
    return [(x.dtype, x.shape[:-1] + (codes.shape[0],))]


def _qembedding(ins, attrs):
    _exponent(attrs)
    ids, codes, scales, mins = ins
    _require(ids.dtype in INTS, f"ids must be integer, got {ids.dtype}")
    dtype = "float32" if scales is None else scales.dtype  # super-blocks dequantize to float32
    if scales is not None:
        _float(scales, "scales")
    return [(dtype, ids.shape + (_blocks(codes, scales, mins, attrs, dtype),))]


def _split(ins, attrs):
    (x,) = ins
    _same(sum(attrs["sizes"]), x.shape[-1], "sum of sizes vs x's last dim")
    return [(x.dtype, x.shape[:-1] + (s,)) for s in attrs["sizes"]]


def _rotary_cos_sin(ins, attrs):
    pos, inv_freq = ins
    _require(pos.dtype in INTS, f"positions must be integer, got {pos.dtype}")
    _require(len(inv_freq.shape) == 1 and inv_freq.dtype == "float32", "inv_freq must be float32 [rotary_dim/2]")
    out = ("float32", pos.shape + inv_freq.shape)
    return [out, out]


def _rotary(ins, attrs):
    x, cos, sin = ins
    _float(x, "x")
    n = attrs["num_heads"]
    _require(x.shape[-1] % n == 0, f"x's last dim {x.shape[-1]} is not num_heads ({n}) * head_dim")
    _same(cos.shape, sin.shape, "cos vs sin shape")
    _same(cos.shape[:-1], x.shape[:-1], "cos leading dims vs x")
    _require(2 * cos.shape[-1] <= x.shape[-1] // n, f"rotary dim {2 * cos.shape[-1]} exceeds head_dim")
    return [(x.dtype, x.shape)]


def _attention(ins, attrs):
    q, k, v, pos, past_k, past_v, slots, sinks = (list(ins) + [None])[:8]
    nq, nkv = attrs["num_heads"], attrs["num_kv_heads"]
    _require(nq % nkv == 0, f"num_heads ({nq}) must be divisible by num_kv_heads ({nkv})")
    _require(attrs["window"] >= 0, f"window ({attrs['window']}) must be >= 0 (0: no window)")
    _require(attrs["softcap"] >= 0, f"softcap ({attrs['softcap']}) must be >= 0 (0: none)")
    _require(q.shape[-1] % nq == 0, "q's last dim must be num_heads * head_dim")
    d = q.shape[-1] // nq
    _same(k.shape, q.shape[:-1] + (nkv * d,), "k shape")
    _same(v.shape, k.shape, "v shape")
    _same(pos.shape, q.shape[:-1], "positions shape vs q's [batch, seq]")
    _require(pos.dtype in INTS, "positions must be integer")
    for t in (k, v):
        _same(t.dtype, q.dtype, "dtype")
    # the cache: q's dtype, or one of llgraph/kv_cache.py's formats (its row: D values, int8's with their scale)
    _require(past_k.dtype in (q.dtype, *(f.dtype for f in FORMATS.values())),
             f"cache dtype {past_k.dtype} is no KV format")
    _same(past_v.dtype, past_k.dtype, "past_value dtype")
    row = of_dtype(past_k.dtype).row(d)
    rows = q.shape[0]  # the cache's rows: the batch's, or (slots) any number, each token naming its own
    if slots is not None:
        _require(slots.dtype == "int64" and len(slots.shape) == 1, f"slots must be int64 [tokens] (each token's "
                 f"cache row; empty: row b), got {slots.dtype}{list(slots.shape)}")
        rows = past_k.shape[0]
    _same(past_k.shape, (rows, nkv, past_k.shape[2], row), "past_key shape [rows, kv_heads, max_seq, row]")
    _same(past_v.shape, past_k.shape, "past_value shape")
    if sinks is not None:
        _require(sinks.dtype == "float32" and sinks.shape == (nq,), f"sinks must be float32 [{nq}] (one logit a "
                 f"query head), got {sinks.dtype}{list(sinks.shape)}")
        _require(not attrs["softcap"], "sinks with softcap: no model has both; drop one")
    return [(q.dtype, q.shape), (past_k.dtype, past_k.shape), (past_v.dtype, past_v.shape)]


def _softcap(ins, attrs):
    (x,) = ins
    _float(x, "x")
    _require(attrs["cap"] > 0, f"cap ({attrs['cap']}) must be > 0")
    return [(x.dtype, x.shape)]


def _swiglu(ins, attrs):
    gate, up = ins
    _float(gate, "gate")
    _same(gate.shape, up.shape, "gate vs up shape")
    return [(gate.dtype, gate.shape)]


def _moe(ins, attrs):
    x, router, gate, up, down, shared_gate, shared_up, shared_down, shared_router, router_bias, gate_bias, up_bias, \
        down_bias = (list(ins) + [None] * 8)[:13]
    _float(x, "x")
    _require(len(router.shape) == 2 and router.shape[1] == x.shape[-1], f"router must be [experts, {x.shape[-1]}], "
             f"got {router.shape}")
    experts = router.shape[0]
    _require(len(gate.shape) == 3 and gate.shape[0] == experts and gate.shape[2] == x.shape[-1],
             f"gate must be [experts, ffn, {x.shape[-1]}], got {gate.shape}")
    _same(up.shape, gate.shape, "up vs gate shape")
    _same(down.shape, (experts, x.shape[-1], gate.shape[1]), "down shape [experts, hidden, ffn]")
    _require(isinstance(experts, str) or 1 <= attrs["top_k"] <= experts,
             f"top_k ({attrs['top_k']}) must be in 1..{experts} (the experts)")
    shared = (shared_gate, shared_up, shared_down, shared_router)
    _require(all(s is None for s in shared) or all(s is not None for s in shared),
             "a shared expert needs all four of shared_gate, shared_up, shared_down and shared_router")
    if shared_gate is not None:
        _require(len(shared_gate.shape) == 2 and shared_gate.shape[1] == x.shape[-1],
                 f"shared_gate must be [shared_ffn, {x.shape[-1]}], got {shared_gate.shape}")
        _same(shared_up.shape, shared_gate.shape, "shared_up vs shared_gate shape")
        _same(shared_down.shape, (x.shape[-1], shared_gate.shape[0]), "shared_down shape [hidden, shared_ffn]")
        _same(shared_router.shape, (1, x.shape[-1]), "shared_router shape [1, hidden]")
    for name, b, shape in (("router_bias", router_bias, (experts,)), ("gate_bias", gate_bias, gate.shape[:2]),
                           ("up_bias", up_bias, gate.shape[:2]), ("down_bias", down_bias, down.shape[:2])):
        if b is not None:
            _same(b.shape, shape, f"{name} shape")
            _float(b, name)
    _require(attrs["alpha"] > 0 and attrs["limit"] >= 0, f"alpha ({attrs['alpha']}) must be > 0 and limit "
             f"({attrs['limit']}) >= 0 (0: no clamp)")
    return [(x.dtype, x.shape)]


def _qmoe(ins, attrs):
    _exponent(attrs)
    _exponent(attrs, "down_exponent")
    x, router, gate, up, down = ins[:5]
    for name, codes, fmt in (("gate", gate, attrs["format"]), ("up", up, attrs["format"]),
                             ("down", down, attrs["down_format"])):
        _require(codes.dtype == "uint8" and len(codes.shape) == 4 and codes.shape[3] == SUPERBLOCK_BYTES[fmt],
                 f"{name} must be uint8 [experts, out, in/{superblock_weights(fmt)}, {SUPERBLOCK_BYTES[fmt]}] ({fmt} "
                 f"super-blocks), got {codes.dtype}{codes.shape}")

    def widened(c, fmt):  # the float experts these codes stand for
        return SimpleNamespace(dtype=x.dtype, shape=(c.shape[0], c.shape[1], c.shape[2] * superblock_weights(fmt)))
    f, fd = attrs["format"], attrs["down_format"]
    return _moe([x, router, widened(gate, f), widened(up, f), widened(down, fd), *ins[5:]], attrs)


def _expert_matmul(ins, attrs):
    x, weight, chosen = ins
    _float(x, "x")
    _require(chosen.dtype == "int64" and len(chosen.shape) == 2, f"chosen must be int64 [tokens, k] (each token's "
             f"experts), got {chosen.dtype}{list(chosen.shape)}")
    _require(len(x.shape) == 3 and x.shape[0] == chosen.shape[0] and x.shape[1] in (1, chosen.shape[1]),
             f"x must be [tokens, 1 or k, in] ({chosen.shape[0]} tokens, k = {chosen.shape[1]}), got {x.shape}")
    _require(len(weight.shape) == 3 and weight.shape[1] == x.shape[2], f"weight must be [experts, {x.shape[2]}, out]"
             f", got {weight.shape}")
    _same(weight.dtype, x.dtype, "weight dtype vs x dtype")
    return [(x.dtype, (x.shape[0], chosen.shape[1], weight.shape[2]))]


def _keep_last(ins, attrs):
    x, keep = ins
    _require(len(x.shape) == 3, f"x must be [batch, seq, features], got {x.shape}")
    _require(keep.dtype == "int64" and keep.shape == (), f"keep must be an int64 scalar, got {keep.dtype}{keep.shape}")
    return [(x.dtype, (x.shape[0], "kept", x.shape[2]))]


def _add(ins, attrs):
    a, b = ins
    _same(a.shape, b.shape, "shapes")
    _same(a.dtype, b.dtype, "dtypes")
    return [(a.dtype, a.shape)]


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
    ), _embedding, "table[ids] * scale"),
    OpSchema("RMSNorm", ("x", "weight"), ("out",), (
        Attr("eps", float),
        Attr("group", int, "features normalized together: the last dim, or a head's (QK-norm per head)"),
    ), _rmsnorm, "each consecutive `group` features of the last axis: x / sqrt(mean(x^2) + eps) * weight, "
                 "computed in float32"),
    OpSchema("Linear", ("x", "weight", "bias?"), ("out",), (), _linear, "x @ weight^T + bias"),
    OpSchema("QLinear", ("x", "codes", "scales?", "mins?", "bias?"), ("out",), QUANT_ATTRS, _qlinear,
             "x @ w^T + bias with w[o, b*B + j] = scales[o, b] * (q[o, b, j] - zero_point) + mins[o, b]; "
             "q unpacked from codes (4-bit: two per byte, low nibble first); or, a super-block format, w as "
             "ggml defines those super-blocks (codes [out, in/256, bytes], no scales or mins); see llgraph/quant.py"),
    OpSchema("QEmbedding", ("ids", "codes", "scales?", "mins?"), ("out",), (
        *QUANT_ATTRS, Attr("scale", float, "multiplies the rows, as Embedding's"),
    ), _qembedding, "Embedding over a blocked table in QLinear's format (a GGUF's token_embd as stored; tied to a "
                    "QLinear lm head, the same codes): the rows ids, dequantized, * scale"),
    OpSchema("Split", ("x",), ("*",), (Attr("sizes", tuple, "sizes along the last axis"),),
             _split, "split the last axis into consecutive pieces"),
    OpSchema("RotaryCosSin", ("positions", "inv_freq"), ("cos", "sin"), (
        Attr("scaling", float, "multiplies cos and sin (YaRN's attention factor)"),
        Attr("dynamic_factor", float, "dynamic NTK factor; 0 disables"),
        Attr("original_max_position", int, "dynamic NTK: positions past this stretch the base"),
    ), _rotary_cos_sin,
        "angles = positions * inv_freq (float32); with dynamic NTK, inv_freq is recomputed for "
        "L = max(positions) + 1 > original_max_position: inv_freq * r^(-2i/(d-2)), r = factor*L/orig - (factor-1)"),
    OpSchema("Rotary", ("x", "cos", "sin"), ("out",), (
        Attr("num_heads", int),
        Attr("interleaved", bool, "pairs (2i, 2i+1) as Meta/GGUF; else (i, i + r/2) as HF"),
    ), _rotary, "rotate the first 2*cos.shape[-1] dims of each head; the rest pass through"),
    OpSchema("GroupedAttention", ("q", "k", "v", "positions", "past_key", "past_value", "slots?", "sinks?"),
             ("out", "present_key", "present_value"), (
        Attr("num_heads", int), Attr("num_kv_heads", int), Attr("scale", float), Attr("causal", bool),
        Attr("window", int, "sliding window: a query sees the slots of the last `window` positions (0: all)"),
        Attr("softcap", float, "logits (after scale) become softcap * tanh(logits / softcap); 0: none (Gemma 2)"),
    ), _attention,
        "write every token's k, v into its cache row (b; with `slots` [B*S] int64, slots[b*S + s], an empty "
        "tensor meaning b) at position positions[b, s] (in the cache's format, llgraph/kv_cache.py: q's dtype, "
        "float16, or int8 rows of D codes and a float32 scale), all of the step's before any query reads; attend "
        "query (b, s) to its row's positions 0..positions[b, s] (causal) or 0..max(positions[b]) (non-causal); "
        "position p lives in slot p mod T of a cache of T slots: T > every position, or, with a window, a ring of "
        "T >= window + (the row's span of positions in the step) - 1 slots (llgraph/kv_cache.py ring_length); kv "
        "head j serves query heads j*g..(j+1)*g-1 with g = num_heads / num_kv_heads. With `sinks` [num_heads] "
        "(gpt-oss), head h's softmax denominator also holds exp(sinks[h]): a logit no value stands behind"),
    OpSchema("SwiGLU", ("gate", "up"), ("out",), (), _swiglu, "silu(gate) * up"),
    OpSchema("MoE", MOE_INPUTS, ("out",), ROUTING, _moe,
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
    ), _qmoe,
        "MoE with its routed experts as a GGUF stores them: gate, up [experts, ffn, hidden/P, bytes] and down "
        "[experts, hidden, ffn/P, bytes], each expert's rows QLinear's super-blocks (format, down_format; P their "
        "weights a block, 256 or 32), w as "
        "ggml dequantizes them; router and the shared expert float, as MoE's"),
    OpSchema("ExpertMatMul", ("x", "weight", "chosen"), ("out",), (), _expert_matmul,
        "out[t, i] = x[t, i] @ weight[chosen[t, i]] (x[t, 0] where x has one row a token): each token's rows "
        "through its chosen experts' matrices, ggml's mul_mat_id. x [tokens, 1 or k, in]; weight [experts, in, out], "
        "as MatMul takes them; chosen [tokens, k] int64 -> [tokens, k, out]. What a MoE's step of few tokens "
        "lowers to (export/onnx_moe.py): TensorRT's plugin reads each chosen expert's matrix in place"),
    OpSchema("GeGLU", ("gate", "up"), ("out",), (), _swiglu, "gelu_tanh(gate) * up (Gemma's MLP)"),
    OpSchema("SoftCap", ("x",), ("out",), (Attr("cap", float),), _softcap,
             "cap * tanh(x / cap) (Gemma 2's final logits)"),
    OpSchema("KeepLast", ("x", "keep"), ("out",), (), _keep_last,
             "x[:, -keep:] (the last `keep` positions; all when keep is 0 or >= seq): the ort target's logits "
             "for the positions a step samples from, not the whole prompt (llgraph/passes.keep_last_positions)"),
    OpSchema("Add", ("a", "b"), ("out",), (), _add, "a + b"),
)}
