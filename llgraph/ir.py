"""The IR: typed values with symbolic shapes, parameters, nodes, an immutable graph, and its verifier.

Imports no torch, onnx or tensorrt. A dim is an int or a name ("batch", "seq", "max_seq"). Node output types are
never written by hand: `GraphBuilder.add` asks the op's schema (ops.py) for them, and `verify` checks them again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from llgraph.errors import LlgraphError
from llgraph.ops import SCHEMAS, check_attrs

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "int8", "bool")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # float64: the reference of references
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "int8": 1,
               "bool": 1}

Dim = int | str


class IRError(LlgraphError):
    """A graph that breaks an op schema or SSA form."""


@dataclass(frozen=True)
class Value:
    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise IRError(f"value {self.name}: unknown dtype {self.dtype}")

    def __str__(self):
        return f"{self.name}: {self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Param:
    """A weight. Its data comes from checkpoint tensors `parts` (one, or several concatenated along axis 0 when a
    packing pass made it), or from `constant` (a numpy array derived from the config, e.g. RoPE inverse
    frequencies, with no parts). With `component`, it is one piece (codes, scales or mins) of the parts' blocked
    integer form (llgraph/quant.py), as the checkpoint stores it or as quantization makes it."""

    value: Value
    parts: tuple[Value, ...] = ()
    constant: Any = None  # numpy.ndarray for derived constants
    component: str | None = None  # "codes" | "scales" | "mins": this piece of the parts' blocked form (quant.py)

    @property
    def name(self) -> str:
        return self.value.name

    @property
    def is_constant(self) -> bool:
        return self.constant is not None


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str | None, ...]  # None marks an absent optional input
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))

    @property
    def name(self) -> str:
        return self.outputs[0]

    def arg(self, i: int) -> str:
        """Input i, which the caller knows is present (a required input, or one it checked)."""
        name = self.inputs[i]
        if name is None:
            raise IRError(f"node {self.name} ({self.op}): input {i} is absent")
        return name


@dataclass(frozen=True)
class Graph:
    inputs: tuple[Value, ...]
    outputs: tuple[Value, ...]
    params: Mapping[str, Param]
    nodes: tuple[Node, ...]
    values: Mapping[str, Value]  # every value: inputs, params, node outputs
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def value(self, name: str) -> Value:
        return self.values[name]

    def producer(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i is not None:
                    out.setdefault(i, []).append(n)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def param_count(self, include_constants: bool = False) -> int:
        total = 0
        for p in self.params.values():
            if include_constants or not p.is_constant:
                size = 1
                for d in p.value.shape:
                    size *= int(d)  # a param's dims are numbers, never symbolic
                total += size
        return total


class GraphBuilder:
    """Appends nodes in order; output types come from the op's schema."""

    def __init__(self):
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.params: dict[str, Param] = {}
        self.nodes: list[Node] = []
        self.values: dict[str, Value] = {}

    def _define(self, v: Value) -> Value:
        if v.name in self.values:
            raise IRError(f"value {v.name} is defined twice")
        self.values[v.name] = v
        return v

    def input(self, name: str, dtype: str, shape: Iterable[Dim]) -> str:
        self.inputs.append(self._define(Value(name, dtype, tuple(shape))))
        return name

    def param(self, name: str, dtype: str, shape: Iterable[Dim], constant=None) -> str:
        v = self._define(Value(name, dtype, tuple(shape)))
        self.params[name] = Param(v, () if constant is not None else (v,), constant)
        return name

    def add(self, op: str, inputs: Iterable[str | None], outputs: Iterable[str], **attrs) -> tuple[str, ...]:
        node = Node(op, tuple(inputs), tuple(outputs), attrs)
        for v in infer(node, self.values):
            self._define(v)
        self.nodes.append(node)
        return node.outputs

    def output(self, name: str) -> None:
        self.outputs.append(self.values[name])

    def build(self, metadata: Mapping[str, Any] | None = None) -> Graph:
        g = Graph(tuple(self.inputs), tuple(self.outputs), dict(self.params), tuple(self.nodes), dict(self.values),
                  dict(metadata or {}))
        verify(g)
        return g


def infer(node: Node, values: Mapping[str, Value]) -> list[Value]:
    """Output values of `node` by its schema's shape/dtype rule; raises IRError naming the node on misuse."""
    schema = SCHEMAS.get(node.op)
    if schema is None:
        raise IRError(f"node {node.name}: unknown op {node.op}; known ops: {', '.join(sorted(SCHEMAS))}")
    try:
        check_attrs(schema, node.attrs)
        required = [not n.endswith("?") for n in schema.inputs]
        if not sum(required) <= len(node.inputs) <= len(schema.inputs):
            raise IRError(f"takes {len(schema.inputs)} inputs {schema.inputs}, got {len(node.inputs)}")
        ins: list[Value | None] = []
        for i, name in enumerate(node.inputs):
            if name is None:
                if required[i]:
                    raise IRError(f"input {schema.inputs[i]} is required")
                ins.append(None)
            elif name not in values:
                raise IRError(f"input {name} is not defined before use")
            else:
                ins.append(values[name])
        ins += [None] * (len(schema.inputs) - len(ins))
        types = schema.infer(ins, node.attrs)
        if schema.outputs != ("*",) and len(node.outputs) != len(schema.outputs):
            raise IRError(f"has {len(schema.outputs)} outputs {schema.outputs}, got {len(node.outputs)}")
        if len(types) != len(node.outputs):
            raise IRError(f"schema gives {len(types)} outputs, node names {len(node.outputs)}")
    except (IRError, ValueError, KeyError, TypeError, IndexError) as e:
        raise IRError(f"node {node.name} ({node.op}): {e}") from None
    return [Value(name, dtype, tuple(shape)) for name, (dtype, shape) in zip(node.outputs, types)]


def verify(g: Graph) -> Graph:
    """SSA, definition before use, every node against its schema, stored types equal inferred ones, no dead
    params. Returns the graph so passes can write `return verify(new_graph)`."""
    seen: dict[str, Value] = {}
    for v in list(g.inputs) + [p.value for p in g.params.values()]:
        if v.name in seen:
            raise IRError(f"value {v.name} is defined twice")
        seen[v.name] = v
    used: set[str] = set()
    for node in g.nodes:
        for v in infer(node, seen):
            if v.name in seen:
                raise IRError(f"value {v.name} is defined twice")
            if g.values.get(v.name) != v:
                raise IRError(f"node {node.name}: stored type {g.values.get(v.name)} differs from inferred {v}")
            seen[v.name] = v
        used.update(i for i in node.inputs if i is not None)
    for v in g.outputs:
        if seen.get(v.name) != v:
            raise IRError(f"graph output {v} is not produced by the graph")
    dead = sorted(set(g.params) - used)
    if dead:
        raise IRError(f"params {', '.join(dead[:5])} are not used by any node")
    if set(seen) != set(g.values):
        raise IRError(f"graph.values lists values no node defines: {sorted(set(g.values) - set(seen))[:5]}")
    return g


def value_order(graph: Graph) -> list[str]:
    """Every activation in the order the graph computes it (inputs and params excluded)."""
    return [o for n in graph.nodes for o in n.outputs]
