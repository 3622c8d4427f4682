"""The IR: schemas drive inference, the verifier rejects broken graphs, every op has an implementation in every
backend, the IR imports no framework, and the packing passes change structure but not numbers."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import max_diff
from reference import Stepper, tiny

from llgraph.builder import build_graph, new_cache
from llgraph.checkpoint import random_weights
from llgraph.executor import TORCH_IMPLS, TorchExecutor
from llgraph.export import TARGETS, get_target
from llgraph.ir import Graph, GraphBuilder, IRError, Node, verify
from llgraph.ops import SCHEMAS
from llgraph.passes import DEFAULT_PASSES, pack_gate_up, pack_qkv, run_passes


def implementations(backend: str) -> set[str]:
    """The ops a backend implements: the torch executor's table, or an ONNX target's lowerings."""
    return set(TORCH_IMPLS) if backend == "torch" else set(get_target(backend).lowerings)


BACKENDS = ["torch", *TARGETS]  # the executor, and every ONNX target's lowering


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_has_an_implementation(backend):
    """Ops x backends: a schema without an implementation (or an implementation without a schema) is a hole."""
    have = implementations(backend)
    assert set(SCHEMAS) == have, f"{backend} misses {set(SCHEMAS) - have}, has unknown {have - set(SCHEMAS)}"


def test_ir_imports_no_framework():
    code = ("import sys, llgraph.ir, llgraph.ops, llgraph.builder, llgraph.passes; "
            "print(sorted(m for m in ('torch', 'onnx', 'tensorrt') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def small_graph_builder():
    b = GraphBuilder()
    b.input("x", "float32", ("batch", "seq", 8))
    b.param("w", "float32", (4, 8))
    return b


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.add("Linear", ("x", "w2", None), ("y",)), "input w2 is not defined before use"),
    (lambda b: b.add("Linear", ("x",), ("y",)), "takes 3 inputs"),
    (lambda b: b.add("RMSNorm", ("x", "w"), ("y",), eps=1e-5, group=4), "weight shape vs group"),
    (lambda b: b.add("RMSNorm", ("x", "w"), ("y",), eps=1e-5, group=3), "group \\(3\\) must divide"),
    (lambda b: b.add("RMSNorm", ("x", "w"), ("y",)), "attributes missing ['eps', 'group']"),
    (lambda b: b.add("Split", ("x",), ("a", "b"), sizes=(3, 3)), "sum of sizes vs x's last dim"),
    (lambda b: b.add("Rotary", ("x", "x", "x"), ("y",), num_heads="2", interleaved=False), "must be int"),
    (lambda b: b.add("Conv", ("x",), ("y",)), "unknown op Conv"),
    (lambda b: b.add("Linear", ("x", "w", None), ("x",)), "value x is defined twice"),
])
def test_builder_rejects_misuse(mutate, message):
    with pytest.raises(IRError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mutate(small_graph_builder())


def test_verifier_rejects_edited_graphs():
    b = small_graph_builder()
    b.add("Linear", ("x", "w", None), ("y",))
    b.output("y")
    g = b.build()
    with pytest.raises(IRError, match="stored type"):  # a value type that disagrees with the schema's rule
        verify(Graph(g.inputs, g.outputs, g.params, g.nodes, {**g.values, "y": g.values["x"].__class__(
            "y", "float32", ("batch", "seq", 5))}))
    with pytest.raises(IRError, match="not used by any node"):
        verify(Graph(g.inputs, (g.values["x"],), g.params, (), {k: g.values[k] for k in ("x", "w")}))
    reordered = (Node("Linear", ("y", "w", None), ("z",)),) + g.nodes
    with pytest.raises(IRError, match="not defined before use"):
        verify(Graph(g.inputs, g.outputs, g.params, reordered, g.values))


def test_packing_changes_structure_not_numbers(report):
    cfg = tiny(attention_bias=True, mlp_bias=True)
    graph = build_graph(cfg)
    packed = run_passes(graph, DEFAULT_PASSES)
    n = cfg.num_layers
    assert graph.op_counts()["Linear"] - packed.op_counts()["Linear"] == 3 * n  # 3 q/k/v + 2 gate/up -> 2
    assert packed.op_counts()["Split"] == 2 * n
    qkv = packed.params["model.layers.0.self_attn.qkv.weight"]
    assert [p.name for p in qkv.parts] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert "model.layers.0.mlp.gate_up.bias" in packed.params
    assert packed.param_count() == graph.param_count()
    assert {v for v in graph.values if not v.startswith("model.")} <= set(packed.values)  # names still traceable
    source = random_weights(cfg, seed=2, std=0.25)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    a = Stepper(cfg, source, batch=2).step(ids)["logits"]
    b = Stepper(cfg, source, batch=2, graph=packed).step(ids)["logits"]
    report("packed vs unpacked logits", max_diff(a, b), 1e-5)


def test_passes_are_pure_and_idempotent():
    graph = build_graph(tiny())
    before = (graph.nodes, dict(graph.params))
    once = pack_gate_up(pack_qkv(graph))
    assert (graph.nodes, dict(graph.params)) == before
    assert pack_gate_up(pack_qkv(once)) is once


def rotary_reference(x, angles, num_heads, rotary_dim, interleaved):
    """RoPE as complex multiplication (Meta's formulation), written independently of the executor."""
    b, s, nd = x.shape
    xh = x.view(b, s, num_heads, nd // num_heads).double()
    rot, rest = xh[..., :rotary_dim], xh[..., rotary_dim:]
    if interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], rotary_dim // 2, 2).contiguous())
    else:
        z = torch.complex(rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:])
    z = z * torch.polar(torch.ones_like(angles), angles)[:, :, None, :]
    rot = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((rot, rest), -1).reshape(b, s, nd)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # whole head, and partial rotary
def test_rotary_matches_complex_reference(interleaved, rotary_dim, report):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3 * 16)
    angles = torch.rand(2, 5, rotary_dim // 2).double() * 20
    node = Node("Rotary", ("x", "cos", "sin"), ("y",), {"num_heads": 3, "interleaved": interleaved})
    (ours,) = TORCH_IMPLS["Rotary"](node, x, angles.cos().float(), angles.sin().float())
    ref = rotary_reference(x, angles, 3, rotary_dim, interleaved)
    report(f"rotary dim {rotary_dim} interleaved={interleaved}", max_diff(ours, ref), 1e-5)


def test_partial_rotary_model_runs_and_caches_consistently(report):
    cfg = tiny(rope={"rotary_dim": 8})
    source = random_weights(cfg, seed=4, std=0.25)
    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    a = Stepper(cfg, source)
    a.step(ids[:, :6])
    report("partial rotary: prefill(6)+decode(1) vs prefill(7)",
           max_diff(a.step(ids[:, 6:])["logits"][:, -1], Stepper(cfg, source).step(ids)["logits"][:, -1]), 1e-5)


def test_attention_sees_only_positions_up_to_its_own(report):
    """Right-padded batch rows at different lengths: row 1's logits equal running row 1 alone."""
    cfg = tiny()
    source = random_weights(cfg, seed=6, std=0.25)
    ex = TorchExecutor(build_graph(cfg), source)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))

    def run(ids, positions):
        cache = new_cache(cfg, ids.shape[0], 16, torch.zeros)
        return ex.run({"input_ids": ids, "position_ids": positions, **cache})["logits"]

    batched = run(ids, torch.arange(6).expand(2, 6))
    alone = run(ids[1:, :4], torch.arange(4)[None])
    report("row in a batch vs alone", max_diff(batched[1, :4], alone[0]), 1e-5)
    assert math.isfinite(batched.abs().max().item())


@pytest.mark.parametrize("dtype, rel", [("float16", 1.5e-2), ("bfloat16", 8e-2)])
def test_executor_half_precisions_track_float64(dtype, rel, report):
    """fp16/bf16 executor runs (prefill + 4 decode steps) stay within rel * max|logits| of the float64 run:
    1.5e-2 for fp16 (10-bit mantissa), 8e-2 for bf16 (7-bit). The std-0.25 weights make attention peaky, which
    magnifies a score's rounding, and the error varies by draw: over seeds 1, 2, 3 and 8, 0.003-0.009 (fp16) and
    0.02-0.11 (bf16) of max|logits|; seed 8 gives 0.0086 and 0.045. A wrong precision anywhere is O(1)."""
    cfg = tiny()
    source = random_weights(cfg, seed=8, std=0.25)
    low, truth = Stepper(cfg, source, dtype=dtype), Stepper(cfg, source, dtype="float64")
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    worst = scale = 0.0
    for _ in range(5):
        a, b = low.step(ids)["logits"], truth.step(ids)["logits"]
        worst, scale = max(worst, max_diff(a, b)), max(scale, b.abs().max().item())
        ids = b[:, -1:].argmax(-1)
    report(f"{dtype} executor vs float64 (|logits| up to {scale:.1f})", worst, rel * scale)
