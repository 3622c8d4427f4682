"""Each op's shape/dtype rule: the `infer` of its schema in llgraph/ops.py, which gives every value's dtype and
shape from the node's inputs and attributes and refuses a node whose inputs disagree with the op (one ValueError
naming what). Also the GGUF super-block sizes the quantized ops' rules and attributes read.
"""

from __future__ import annotations

from types import SimpleNamespace

from llgraph.kv_cache import FORMATS, of_dtype

FLOATS = ("float32", "float16", "bfloat16", "float64")
INTS = ("int64", "int32")


def _require(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


def _float(v, what):
    _require(v.dtype in FLOATS, f"{what} must be a float tensor, got {v.dtype}")


def _same(a, b, what):
    _require(a == b, f"{what}: {a} != {b}")


def embedding(ins, attrs):
    ids, table = ins
    _require(ids.dtype in INTS, f"ids must be integer, got {ids.dtype}")
    _require(len(table.shape) == 2, f"table must be 2-D, got {table.shape}")
    return [(table.dtype, ids.shape + (table.shape[1],))]


def rmsnorm(ins, attrs):
    x, w = ins
    _float(x, "x")
    g = attrs["group"]
    _require(g > 0 and x.shape[-1] % g == 0, f"group ({g}) must divide x's last dim ({x.shape[-1]})")
    _same(w.shape, (g,), "weight shape vs group")
    return [(x.dtype, x.shape)]


def linear(ins, attrs):
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
    _require(attrs[name] == 0 or (attrs["format"] != "blocks" and -8 <= attrs[name] <= 8),
             f"{name} ({attrs[name]}) must be 0, or within -8..8 on super-blocks")


def qlinear(ins, attrs):
    _exponent(attrs)
    x, codes, scales, mins, b = ins
    _float(x, "x")
    _same(_blocks(codes, scales, mins, attrs, x.dtype), x.shape[-1], "the codes' input features vs x's last dim")
    if b is not None:
        _same(b.shape, (codes.shape[0],), "bias shape vs out-features")
    return [(x.dtype, x.shape[:-1] + (codes.shape[0],))]


def qembedding(ins, attrs):
    _exponent(attrs)
    ids, codes, scales, mins = ins
    _require(ids.dtype in INTS, f"ids must be integer, got {ids.dtype}")
    dtype = "float32" if scales is None else scales.dtype  # super-blocks dequantize to float32
    if scales is not None:
        _float(scales, "scales")
    return [(dtype, ids.shape + (_blocks(codes, scales, mins, attrs, dtype),))]


def split(ins, attrs):
    (x,) = ins
    _same(sum(attrs["sizes"]), x.shape[-1], "sum of sizes vs x's last dim")
    return [(x.dtype, x.shape[:-1] + (s,)) for s in attrs["sizes"]]


def rotary_cos_sin(ins, attrs):
    pos, inv_freq = ins
    _require(pos.dtype in INTS, f"positions must be integer, got {pos.dtype}")
    _require(len(inv_freq.shape) == 1 and inv_freq.dtype == "float32", "inv_freq must be float32 [rotary_dim/2]")
    out = ("float32", pos.shape + inv_freq.shape)
    return [out, out]


def rotary(ins, attrs):
    x, cos, sin = ins
    _float(x, "x")
    n = attrs["num_heads"]
    _require(x.shape[-1] % n == 0, f"x's last dim {x.shape[-1]} is not num_heads ({n}) * head_dim")
    _same(cos.shape, sin.shape, "cos vs sin shape")
    _same(cos.shape[:-1], x.shape[:-1], "cos leading dims vs x")
    _require(2 * cos.shape[-1] <= x.shape[-1] // n, f"rotary dim {2 * cos.shape[-1]} exceeds head_dim")
    return [(x.dtype, x.shape)]


def attention(ins, attrs):
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


def softcap(ins, attrs):
    (x,) = ins
    _float(x, "x")
    _require(attrs["cap"] > 0, f"cap ({attrs['cap']}) must be > 0")
    return [(x.dtype, x.shape)]


def swiglu(ins, attrs):
    gate, up = ins
    _float(gate, "gate")
    _same(gate.shape, up.shape, "gate vs up shape")
    return [(gate.dtype, gate.shape)]


def moe(ins, attrs):
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


def qmoe(ins, attrs):
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
    return moe([x, router, widened(gate, f), widened(up, f), widened(down, fd), *ins[5:]], attrs)


def expert_matmul(ins, attrs):
    x, weight, chosen, *schedule = ins
    for name, v in zip(("order", "blocks"), schedule):
        if v is not None:
            _require(v.dtype == "int64" and len(v.shape) == 1, f"{name} must be int64 and 1-D (the pairs grouped by "
                     f"expert, export/expert_schedule.py), got {v.dtype}{list(v.shape)}")
    _float(x, "x")
    _require(chosen.dtype == "int64" and len(chosen.shape) == 2, f"chosen must be int64 [tokens, k] (each token's "
             f"experts), got {chosen.dtype}{list(chosen.shape)}")
    _require(len(x.shape) == 3 and x.shape[0] == chosen.shape[0] and x.shape[1] in (1, chosen.shape[1]),
             f"x must be [tokens, 1 or k, in] ({chosen.shape[0]} tokens, k = {chosen.shape[1]}), got {x.shape}")
    _require(len(weight.shape) == 3 and weight.shape[1] == x.shape[2], f"weight must be [experts, {x.shape[2]}, out]"
             f", got {weight.shape}")
    _same(weight.dtype, x.dtype, "weight dtype vs x dtype")
    return [(x.dtype, (x.shape[0], chosen.shape[1], weight.shape[2]))]


def keep_last(ins, attrs):
    x, keep = ins
    _require(len(x.shape) == 3, f"x must be [batch, seq, features], got {x.shape}")
    _require(keep.dtype == "int64" and keep.shape == (), f"keep must be an int64 scalar, got {keep.dtype}{keep.shape}")
    return [(x.dtype, (x.shape[0], "kept", x.shape[2]))]


def add(ins, attrs):
    a, b = ins
    _same(a.shape, b.shape, "shapes")
    _same(a.dtype, b.dtype, "dtypes")
    return [(a.dtype, a.shape)]
