"""A routed step's (token, slot) pairs grouped by expert, in standard ONNX ops, for ExpertMatMul's TensorRT kernel
(plugins/tensorrt/triton_kernels.py): what ggml's mul_mat_id and vLLM's fused MoE sort before their grouped
products, so that each program multiplies a run of `rows` pairs of one expert by that expert's matrix, read once for
them.

From chosen [tokens, k] (P = tokens * k pairs, E experts, R = `rows`):
- `order` [NB * R]: pair ids (t * k + i) by expert, in pair order within an expert, each expert's run padded to a
  multiple of R with P (no pair);
- `blocks` [NB]: the expert of each run of R (E past the last: nothing to do);
- NB = min(E, P) + floor(P / R), a bound on sum_e ceil(count_e / R) (at most min(E, P) experts have pairs, and
  each has at most one run beyond floor(count_e / R)) known from the shape alone, so no size depends on the values
  (TensorRT builds it as it builds shapes): a decode step's k pairs make k programs with work, not E.

A counting sort: one-hot [P, E], its exclusive CumSum down the pairs (a pair's rank among its expert's), the counts,
each expert's first run. No TopK (TensorRT's K is bounded below a prefill's P) and no NonZero (a size from values).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from llgraph.export.lower import Emitter


def schedule(em: Emitter, chosen: str, experts: int, rows: int, hint: str) -> tuple[str, str]:
    """(order, blocks) for `chosen` [tokens, k] int64 with `experts` experts, `rows` pairs a run."""
    def n(op, *inputs, **attrs):
        return em.node(op, list(inputs), hint=hint, **attrs)[0]

    def c(*values):
        return em.const(np.array(values, np.int64), hint=hint)

    def scalar(value):
        return em.const(np.array(value, np.int64), hint=hint)
    flat = n("Reshape", chosen, c(-1))  # [P]
    column = n("Unsqueeze", flat, c(1))  # [P, 1]
    onehot = n("Cast", n("Equal", column, em.const(np.arange(experts, dtype=np.int64), hint=hint)),
               to=TensorProto.INT64)  # [P, E]
    before = n("CumSum", onehot, scalar(0), exclusive=1)  # [P, E]
    rank = n("Squeeze", n("GatherElements", before, column, axis=1), c(1))  # [P]: its place among its expert's
    counts = n("ReduceSum", onehot, c(0), keepdims=0)  # [E]
    runs = n("Div", n("Add", counts, c(rows - 1)), c(rows))  # [E]: ceil(count / R)
    ends = n("CumSum", runs, scalar(0))  # [E]: one past each expert's last run
    first = n("Sub", ends, runs)
    place = n("Add", n("Mul", n("Gather", first, flat, axis=0), c(rows)), rank)  # [P]: its slot in `order`
    pairs = n("Shape", flat)  # [1]
    bound = n("Add", n("Min", pairs, c(experts)), n("Div", pairs, c(rows)))  # [1]: NB
    ids = n("Range", scalar(0), n("Squeeze", pairs, c(0)), scalar(1))  # [P]
    empty = n("Expand", pairs, n("Mul", bound, c(rows)))  # [NB * R], every slot P (no pair)
    order = n("ScatterElements", empty, place, ids, axis=0)
    run = n("Unsqueeze", n("Range", scalar(0), n("Squeeze", bound, c(0)), scalar(1)), c(1))  # [NB, 1]
    owner = n("Cast", n("LessOrEqual", n("Unsqueeze", ends, c(0)), run), to=TensorProto.INT64)  # [NB, E]
    blocks = n("ReduceSum", owner, c(1), keepdims=0)  # [NB]: how many experts end at or before the run: its own
    return order, blocks


def model(experts: int, rows: int):
    """The schedule as an ONNX model of its own (chosen [tokens, k] int64 -> order, blocks): what the tests
    and the kernel's benchmark run through ONNX Runtime, and TensorRT builds alone."""
    em = Emitter(graph=None, source=None, data=None)
    outputs = schedule(em, "chosen", experts, rows, "s")
    graph = helper.make_graph(em.nodes, "schedule", [helper.make_tensor_value_info("chosen", TensorProto.INT64,
                                                                                   ["tokens", "k"])],
                              [helper.make_tensor_value_info(o, TensorProto.INT64, ["n"]) for o in outputs],
                              initializer=em.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


def run(chosen: np.ndarray, experts: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, blocks) for chosen [tokens, k], the model above run by ONNX Runtime on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(model(experts, rows).SerializeToString(), providers=["CPUExecutionProvider"])
    order, blocks = session.run(None, {"chosen": np.ascontiguousarray(chosen, dtype=np.int64)})
    return order, blocks
