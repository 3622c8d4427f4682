"""The plugin kernels: under TRITON_INTERPRET=1 on CPU tensors they match the PyTorch executor's op (fp32 <= 1e-5,
fp16 <= 1e-2) — RMSNorm, SwiGLU, Rotary, GroupedAttention (prefill and decode, GQA ratios 1/3/4/8, head_dim 64
and 128, positions up to the last cache slot) and ExpertMatMul (against float64); compiled ahead of time they give
PTX for sm_80 and sm_90 that ptxas assembles. On a GPU, `test_kernels_on_cuda` reruns the same comparisons compiled
for it (LLGRAPH_KERNEL_DEVICE=cuda, no interpreter)."""

import os

DEVICE = os.environ.get("LLGRAPH_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import expert_schedule, max_diff, need  # noqa: E402

from llgraph.executor import TORCH_IMPLS  # noqa: E402
from llgraph.ir import Node  # noqa: E402

triton = need("triton", linux_x86_64=True)
from llgraph.plugins.tensorrt import spec  # noqa: E402
from llgraph.plugins.tensorrt import triton_kernels as kernels  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = list(TOL)


def reference(op, *inputs, **attrs):
    """The executor's implementation of `op`: its output, or its tuple of outputs."""
    outs = TORCH_IMPLS[op](Node(op, tuple(f"i{k}" for k in range(len(inputs))), ("y",), attrs), *inputs)
    return outs[0] if len(outs) == 1 else outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden, group", [(1, 576, 576), (37, 576, 576), (5, 4096, 4096), (3, 100, 100),
                                                   (7, 512, 128), (2, 96, 32)])  # decode, prefill, odd, per head
def test_rmsnorm(dtype, tokens, hidden, group, report):
    torch.manual_seed(0)
    x, w = torch.randn(1, tokens, hidden).to(DEVICE, dtype) * 3, (torch.rand(group) + 0.5).to(DEVICE, dtype)
    report(f"rmsnorm {dtype} [{tokens}, {hidden}] groups of {group}",
           max_diff(kernels.rmsnorm(x, w, 1e-5), reference("RMSNorm", x, w, eps=1e-5, group=group)), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (2, 19, 1536), (1, 3, 1000)])
def test_swiglu(dtype, shape, report):
    torch.manual_seed(1)
    g, u = torch.randn(shape).to(DEVICE, dtype) * 4, torch.randn(shape).to(DEVICE, dtype)
    report(f"swiglu {dtype} {shape}", max_diff(kernels.swiglu(g, u), reference("SwiGLU", g, u)), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens, heads, head_dim, rotary_dim", [
    (1, 9, 64, 64), (23, 8, 128, 128), (4, 3, 64, 32), (2, 32, 128, 128)])  # decode, prefill, partial, 8B-sized
def test_rotary(dtype, interleaved, tokens, heads, head_dim, rotary_dim, report):
    torch.manual_seed(2)
    x = torch.randn(1, tokens, heads * head_dim).to(DEVICE, dtype)
    angles = torch.rand(1, tokens, rotary_dim // 2, device=DEVICE) * 8000  # positions near a long max_seq
    cos, sin = angles.cos(), angles.sin()
    got = kernels.rotary(x, cos, sin, heads, interleaved)
    want = reference("Rotary", x, cos, sin, num_heads=heads, interleaved=interleaved)
    report(f"rotary {dtype} interleaved={interleaved} [{tokens}, {heads}x{head_dim}] r={rotary_dim}",
           max_diff(got, want), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, heads, kv_heads, head_dim, max_seq, start, window, softcap", [
    (2, 7, 8, 8, 64, 64, 0, 0, 0.0),        # prefill, MHA (ratio 1)
    (1, 1, 9, 3, 64, 64, 20, 0, 0.0),       # decode, ratio 3 (SmolLM2's heads)
    (2, 5, 16, 4, 128, 64, 10, 0, 0.0),     # prefill onto a cache, ratio 4
    (2, 1, 32, 4, 128, 256, 249, 0, 0.0),   # decode near max_seq, ratio 8
    (1, 6, 8, 1, 64, 256, 250, 0, 0.0),     # prefill ending at the last slot, MQA
    (2, 9, 8, 2, 64, 128, 40, 5, 0.0),      # sliding window: prefill onto a cache, shorter than the tokens
    (2, 1, 8, 2, 64, 128, 90, 37, 0.0),     # sliding window: decode, more than a block of keys
    (2, 6, 8, 2, 64, 128, 30, 0, 1.5),      # soft-capped logits (Gemma 2), prefill onto a cache
    (1, 1, 8, 4, 64, 128, 70, 16, 1.5),     # soft-capped and windowed decode
])
def test_grouped_attention(dtype, batch, seq, heads, kv_heads, head_dim, max_seq, start, window, softcap, report):
    """Rows of a batch at different positions; caches pre-filled with noise, so reading past a row's position
    would show."""
    import math

    torch.manual_seed(3)
    q = torch.randn(batch, seq, heads * head_dim).to(DEVICE, dtype)
    k, v = (torch.randn(batch, seq, kv_heads * head_dim).to(DEVICE, dtype) for _ in range(2))
    positions = (torch.arange(seq) + start + torch.arange(batch)[:, None]).clamp(max=max_seq - 1)
    positions = positions - (positions[:, -1:] - (max_seq - 1)).clamp(min=0)  # keep rows contiguous and in range
    positions = positions.to(DEVICE)
    key, value = (torch.randn(batch, kv_heads, max_seq, head_dim).to(DEVICE, dtype) for _ in range(2))
    ref_key, ref_value = key.clone(), value.clone()
    attrs = dict(num_heads=heads, num_kv_heads=kv_heads, scale=1 / math.sqrt(head_dim), window=window,
                 softcap=softcap)
    want, _, _ = reference("GroupedAttention", q, k, v, positions, ref_key, ref_value, causal=True, **attrs)
    got = kernels.grouped_attention(q, k, v, positions, key, value, heads, kv_heads, attrs["scale"], window, softcap)
    report(f"attention {dtype} B{batch} S{seq} {heads}/{kv_heads} D{head_dim} pos {positions.min()}..{positions.max()}"
           f" window {window} softcap {softcap}",
           max_diff(got, want), TOL[dtype])
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)  # the same slots written, bit for bit



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, start, window", [(2, 7, 0, 0), (2, 9, 40, 5), (2, 1, 90, 37), (1, 1, 3, 0)])
def test_grouped_attention_with_sinks(dtype, batch, seq, start, window, report):
    """gpt-oss's sinks (a logit per head in the denominator): prefill, windowed prefill onto a cache, windowed
    decode past a block, and decode at position 3 where a few keys meet sinks of their size. Sinks drawn around the
    scores' own scale (some heads' sink dominant, some negligible), so a kernel that dropped them would show."""
    import math

    torch.manual_seed(5)
    heads, kv_heads, head_dim, max_seq = 8, 2, 64, 128
    q = torch.randn(batch, seq, heads * head_dim).to(DEVICE, dtype)
    k, v = (torch.randn(batch, seq, kv_heads * head_dim).to(DEVICE, dtype) for _ in range(2))
    positions = (torch.arange(seq) + start + torch.arange(batch)[:, None]).to(DEVICE)
    key, value = (torch.randn(batch, kv_heads, max_seq, head_dim).to(DEVICE, dtype) for _ in range(2))
    ref_key, ref_value = key.clone(), value.clone()
    sinks = (torch.randn(heads) * 3).to(DEVICE)
    attrs = dict(num_heads=heads, num_kv_heads=kv_heads, scale=1 / math.sqrt(head_dim), window=window, softcap=0.0)
    want, _, _ = reference("GroupedAttention", q, k, v, positions, ref_key, ref_value, None, sinks, causal=True,
                           **attrs)
    plain, _, _ = reference("GroupedAttention", q, k, v, positions, ref_key.clone(), ref_value.clone(), causal=True,
                            **attrs)
    assert max_diff(plain, want) > 10 * TOL[dtype]  # the sinks matter at these values
    got = kernels.grouped_attention(q, k, v, positions, key, value, heads, kv_heads, attrs["scale"], window,
                                    sinks=sinks)
    report(f"attention with sinks {dtype} B{batch} S{seq} pos {positions.min()}..{positions.max()} window {window}",
           max_diff(got, want), TOL[dtype])
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)


@pytest.mark.parametrize("dtype, window, softcap", [(torch.float32, 0, 0.0), (torch.float16, 0, 0.0),
                                                    (torch.float32, 6, 0.0), (torch.float32, 0, 1.5)])
def test_grouped_attention_ragged_rows_by_slot(dtype, window, softcap, report):
    """Ragged rows by slot id (GroupedAttention's `slots`), laid out as the engine packs a step (one batch row:
    each add's tokens without logits first, then the ones whose logits are wanted): a decode token with two
    drafts in row 5, a 20-token prompt chunk in row 0 onto a cached prefix, a fresh 3-token prompt in row 2; rows
    1, 3, 4, 6 and 7 idle. Caches hold noise, so a read of a slot the call did not write, or of another row, would
    show; the idle rows must come back bit for bit."""
    import math

    torch.manual_seed(4)
    heads, kv_heads, head_dim, max_seq = 8, 2, 64, 96
    adds = [(5, 30, 3, 3), (0, 17, 20, 1), (2, 0, 3, 1)]  # (cache row, first position, tokens, kept)
    body = [(r, p0 + j) for r, p0, n, kept in adds for j in range(n - kept)]
    tail = [(r, p0 + j) for r, p0, n, kept in adds for j in range(n - kept, n)]
    slots, positions = (torch.tensor([c for c in column])[None] for column in zip(*body, *tail))
    tokens = slots.shape[1]
    q = torch.randn(1, tokens, heads * head_dim).to(DEVICE, dtype)
    k, v = (torch.randn(1, tokens, kv_heads * head_dim).to(DEVICE, dtype) for _ in range(2))
    key, value = (torch.randn(8, kv_heads, max_seq, head_dim).to(DEVICE, dtype) for _ in range(2))
    ref_key, ref_value = key.clone(), value.clone()
    attrs = dict(num_heads=heads, num_kv_heads=kv_heads, scale=1 / math.sqrt(head_dim), window=window,
                 softcap=softcap)
    slots, positions = slots.to(DEVICE), positions.to(DEVICE)
    want, _, _ = reference("GroupedAttention", q, k, v, positions, ref_key, ref_value, slots.reshape(-1), causal=True,
                           **attrs)
    got = kernels.grouped_attention(q, k, v, positions, key, value, heads, kv_heads, attrs["scale"], window, softcap,
                                    slots=slots.reshape(-1))
    report(f"ragged attention {dtype} {tokens} tokens of rows 5, 0, 2 among 8 window {window} softcap {softcap}",
           max_diff(got, want), TOL[dtype])
    assert torch.equal(key, ref_key) and torch.equal(value, ref_value)  # the same slots written, idle rows untouched

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, rows, experts, top_k, in_features, out_features", [
    (1, 1, 8, 2, 128, 96), (3, 2, 8, 2, 96, 130), (2, 1, 64, 8, 70, 64), (5, 4, 6, 4, 64, 64),  # decode, odd, wide
    (70, 1, 4, 2, 96, 80), (45, 3, 4, 3, 64, 72)])  # a prefill: several runs of 32 an expert, partial last runs
def test_expert_matmul(dtype, tokens, rows, experts, top_k, in_features, out_features, report):
    """Gate/up (one row a token for all k) and down (a row each), widths not a multiple of a block; chosen experts
    repeat across tokens and the last expert is among them; the pairs grouped by expert as the `trt` export groups
    them (export/expert_schedule.py's nodes, run by ONNX Runtime)."""
    torch.manual_seed(5)
    x = torch.randn(tokens, rows, in_features).to(DEVICE, dtype)
    w = (torch.randn(experts, in_features, out_features) / in_features ** 0.5).to(DEVICE, dtype)
    chosen = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    chosen[0, -1] = experts - 1 if (chosen[0, :-1] != experts - 1).all() else chosen[0, -1]
    schedule = [torch.from_numpy(a).to(DEVICE) for a in expert_schedule(chosen.cpu().numpy(), experts,
                                                                         spec.EXPERT_ROWS)]
    blocks = schedule[1]
    want = reference("ExpertMatMul", x.double(), w.double(), chosen)
    got = kernels.expert_matmul(x, w, chosen, *schedule)
    report(f"expert matmul {dtype} {tokens} tokens x {rows} rows, {top_k} of {experts} experts [{in_features}, "
           f"{out_features}], {int((blocks < experts).sum())} runs, vs float64", max_diff(got, want), TOL[dtype])
    alone = kernels.expert_matmul(x[:1], w, chosen[:1], *(torch.from_numpy(a).to(DEVICE) for a in expert_schedule(
        chosen[:1].cpu().numpy(), experts, spec.EXPERT_ROWS)))
    assert torch.equal(alone[0], got[0])  # a token's rows are the same bits alone as among the others of its runs


AOT = """
import sys
from llgraph.plugins.tensorrt import spec
from llgraph.plugins.tensorrt.aot import PTX_FLOOR, assemble, compile_op
attn = dict(num_heads=32, num_kv_heads=4, scale=0.125, causal=True, window=0, softcap=0.0)
cases = [("RMSNorm", dict(x=(1, 7, 4096)), dict(eps=1e-5, group=4096)),
         ("RMSNorm", dict(x=(1, 7, 4096)), dict(eps=1e-5, group=128)), ("SwiGLU", dict(gate=(1, 7, 14336)), {}),
         ("Rotary", dict(x=(1, 7, 4096), cos=(1, 7, 64)), dict(num_heads=32, interleaved=False)),
         ("Rotary", dict(x=(1, 7, 576), cos=(1, 7, 32)), dict(num_heads=9, interleaved=True)),
         ("GroupedAttention", dict(q=(1, 7, 4096), past_key=(1, 8, 512, 128), slots=(0,)), attn),
         ("GroupedAttention", dict(q=(1, 1, 576), past_key=(1, 3, 512, 64), slots=(1,)),
          dict(attn, num_heads=9, num_kv_heads=3)),
         ("GroupedAttention", dict(q=(1, 7, 4096), past_key=(8, 8, 512, 128), slots=(7,)), dict(attn, window=4096)),
         ("GroupedAttention", dict(q=(1, 1, 4096), past_key=(1, 8, 512, 128), slots=(0,)), dict(attn, softcap=50.0)),
         ("ExpertMatMul", dict(x=(1, 1, 2048), weight=(128, 2048, 768), chosen=(1, 8), order=(8 * 32,),
                               blocks=(8,)), {}),
         ("ExpertMatMul", dict(x=(512, 8, 768), weight=(128, 768, 2048), chosen=(512, 8), order=(256 * 32,),
                               blocks=(256,)), {})]
for cc in [int(sys.argv[1])]:
    for dtype in ("float32", "float16", "bfloat16"):
        for op, shapes, attrs in cases:
            c, launch = compile_op(op, dtype, shapes, attrs, cc)
            target = ".target sm_90a" if cc == 90 else ".target sm_80"
            assert target in c.ptx and c.name in c.ptx and c.num_warps > 0, (op, dtype, cc)
            # within the 48 KiB of shared memory a launch gets without opting in to more
            assert c.shared_bytes <= 48 * 1024, (op, dtype, cc, c.shared_bytes)
            # what a TensorRT AOT launch passes: inputs, the int32 scalars, outputs; nothing of Triton's scratch
            passed = len(spec.inputs(op)) + len(launch.scalars) + len(spec.outputs(op))
            declared = c.ptx[c.ptx.index(".entry " + c.name):].split(")")[0].count(".param")
            assert declared == passed, (op, dtype, cc, declared, passed)
            assert ".version %d.%d\\n" % PTX_FLOOR[cc] in c.ptx, (op, dtype, cc, c.ptx[:300])
            cubin = assemble(c.ptx, cc)
            assert cubin[:4] == b"\\x7fELF", (op, dtype, cc)
    print(f"sm_{cc}: {len(cases) * 3} kernels compiled to PTX and assembled")
"""


def test_aot_compiles_to_ptx_that_ptxas_assembles():
    """sm_80 and sm_90 side by side, a process each (each compiles on one core)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    runs = [subprocess.Popen([sys.executable, "-c", AOT, str(cc)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env) for cc in (80, 90)]
    out = ""
    for run in runs:
        stdout, stderr = run.communicate()
        print(stdout)
        assert run.returncode == 0, stderr[-3000:]
        out += stdout
    assert "sm_80: 33 kernels" in out and "sm_90: 33 kernels" in out  # 11 cases x 3 dtypes


def test_ptx_for_tensorrt_drops_only_unread_parameters():
    """fit_for_tensorrt on a hand-written entry: the trailing scratch pointers go when the body never names them,
    and a body that reads one is refused (TensorRT would launch it without that argument)."""
    from llgraph.plugins.tensorrt.aot import fit_for_tensorrt

    ptx = (".version 9.4\n.target sm_90a\n.address_size 64\n.visible .entry k(\n\t.param .u64 k_param_0,\n"
           "\t.param .u32 k_param_1,\n\t.param .u64 k_param_2,\n\t.param .u64 k_param_3\n)\n{\n"
           "\tld.param.u64 %rd1, [k_param_0];\n\tret;\n}\n")
    fitted = fit_for_tensorrt(ptx, "k", 2, 90)
    assert fitted.startswith(".version 8.0\n") and fitted.count(".param .u") == 2 and "k_param_2" not in fitted
    with pytest.raises(RuntimeError, match="reads its parameter k_param_3"):
        fit_for_tensorrt(ptx.replace("[k_param_0]", "[k_param_3]"), "k", 2, 90)
    with pytest.raises(RuntimeError, match="fewer than the 5"):
        fit_for_tensorrt(ptx, "k", 5, 90)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or DEVICE == "cuda", reason="needs a CUDA GPU (none here)")
def test_kernels_on_cuda():
    """The comparisons above, compiled for this GPU instead of interpreted (a separate process: the interpreter
    switch is read when triton is imported)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"LLGRAPH_KERNEL_DEVICE": "cuda"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", __file__, "-k", "not aot and not on_cuda"],
                       capture_output=True, text=True, env=env)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
