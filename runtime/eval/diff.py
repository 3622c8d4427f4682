"""Per-value numeric comparison between two backends: where an engine starts to disagree, not just that it does.

A *side* runs a fixed list of steps (prefill, then decode steps; each a dict of input_ids and position_ids) and
returns, per step, {IR value name: array} for every value it exposes: the PyTorch executor records all of them; an
ONNX export exposes its node outputs, whose names are the IR's. `compare` walks the values in graph order, so the
first failing value is where the disagreement starts. Side A's greedy tokens drive the steps, so both sides see
identical inputs. Saved runs are compressed .npz archives of the inputs and a chosen subset of values, so a CPU run
can be compared with a GPU run later. The sides are the backends' own (each backend module's `*_side`, found by
name through runtime/backends/__init__.py: torch, ort, onnx, trt), each recording through the backend's own
forward (`Backend.record`): the values compared are those of the path that serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Step = dict[str, np.ndarray]  # input_ids, position_ids
Values = dict[str, np.ndarray]  # value name -> array
Capture = list[Values]  # per step
Side = Callable[[], Callable[[Step], Values]]  # a fresh stepper (with an empty cache) per call


@dataclass
class ValueDiff:
    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    rel_l2: float  # |b - a| / |a| over the whole tensor: robust where a has near-zero elements
    cosine: float
    passed: bool


@dataclass
class StepReport:
    step: int
    values: list[ValueDiff]

    @property
    def first_divergence(self) -> ValueDiff | None:
        return next((v for v in self.values if not v.passed), None)


@dataclass
class DiffReport:
    steps: list[StepReport]
    outputs: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> tuple[int, ValueDiff] | None:
        for s in self.steps:
            if s.first_divergence is not None:
                return s.step, s.first_divergence
        return None

    @property
    def passed(self) -> bool:
        """Every final output (logits, present caches) within tolerance at every step."""
        return all(v.passed for s in self.steps for v in s.values if v.name in self.outputs)


def value_diff(name: str, a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> ValueDiff:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    err = np.abs(a64 - b64)
    cos = float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64) + 1e-30))
    passed = bool(np.all(err <= atol + rtol * np.abs(a64)))  # numpy.allclose with A as the reference
    rel_l2 = float(np.linalg.norm(a64 - b64) / (np.linalg.norm(a64) + 1e-30))
    return ValueDiff(name, tuple(a.shape), float(err.max(initial=0)),
                     float((err / (np.abs(a64) + 1e-12)).max(initial=0)), rel_l2, cos, passed)


def compare(a: Capture, b: Capture, order: list[str], outputs: list[str], atol: float = 1e-4,
            rtol: float = 1e-3) -> DiffReport:
    steps = []
    for i, (sa, sb) in enumerate(zip(a, b)):
        names = [n for n in order if n in sa and n in sb]
        steps.append(StepReport(i, [value_diff(n, sa[n], sb[n], atol, rtol) for n in names]))
    return DiffReport(steps, outputs)


def run_steps(side: Side, inputs: list[Step]) -> Capture:
    step = side()
    return [step(s) for s in inputs]


def greedy_steps(side: Side, prompt: list[int], steps: int) -> tuple[list[Step], Capture]:
    """Prefill + `steps` decode steps, each next token chosen greedily from this side's logits."""
    step = side()
    inputs = [{"input_ids": np.array([prompt], np.int64), "position_ids": np.arange(len(prompt))[None]}]
    capture = [step(inputs[0])]
    for i in range(steps):
        token = int(capture[-1]["logits"][0, -1].argmax())
        inputs.append({"input_ids": np.array([[token]], np.int64),
                       "position_ids": np.array([[len(prompt) + i]], np.int64)})
        capture.append(step(inputs[-1]))
    return inputs, capture


# -- saved runs (compressed numpy archives) -------------------------------------------------------------------------

SAVE_SUBSETS = ("outputs", "layers", "all")


def keep_values(subset: str, outputs: list[str]) -> Callable[[str], bool]:
    """Which values a saved run keeps: `outputs` (logits, present caches), `layers` (those plus every decoder layer's
    output and the embedding: enough to locate the first failing layer; the default) or `all`."""
    if subset not in SAVE_SUBSETS:
        raise ValueError(f"unknown subset '{subset}'; use one of {', '.join(SAVE_SUBSETS)}")
    if subset == "all":
        return lambda name: True
    if subset == "outputs":
        return lambda name: name in outputs
    return lambda name: name in outputs or name.endswith(".out") or name == "embed"


def save_run(path: str | Path, name: str, inputs: list[Step], capture: Capture,
             keep: Callable[[str], bool] = lambda name: True) -> int:
    """Write a run (its inputs and the kept values) as one compressed .npz; returns its size in bytes. Written
    under a temporary name and renamed."""
    path = Path(path)
    arrays = {"__name__": np.array(name)}
    for i, (step, values) in enumerate(zip(inputs, capture)):
        arrays |= {f"inputs/{i}/{k}": v for k, v in step.items()}
        arrays |= {f"values/{i}/{k}": v for k, v in values.items() if keep(k)}
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)  # type: ignore[arg-type]  # numpy's stub: **kwds as allow_pickle
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def load_run(path: str | Path) -> tuple[str, list[Step], Capture]:
    with np.load(path, allow_pickle=False) as z:
        steps = 1 + max(int(k.split("/")[1]) for k in z.files if k.startswith("inputs/"))
        inputs: list[Step] = [{} for _ in range(steps)]
        capture: Capture = [{} for _ in range(steps)]
        for k in z.files:
            if k != "__name__":
                kind, i, name = k.split("/", 2)
                (inputs if kind == "inputs" else capture)[int(i)][name] = z[k]
        return str(z["__name__"]), inputs, capture


# -- printing -------------------------------------------------------------------------------------------------------

def format_report(report: DiffReport, a: str, b: str, atol: float, rtol: float, all_values: bool = False) -> str:
    lines = [f"{a} vs {b}: pass = |{b} - {a}| <= {atol:g} + {rtol:g} * |{a}| everywhere"]
    for s in report.steps:
        lines.append(f"\nstep {s.step} ({'prefill' if s.step == 0 else 'decode'}): {len(s.values)} values")
        lines.append(f"  {'value':<28}{'shape':<20}{'max abs':>10}{'max rel':>10}{'cosine':>10}  ")
        shown = s.values if all_values else [v for v in s.values if not v.passed or v.name in report.outputs
                                             or v.name.endswith(".out")]
        for v in shown:
            lines.append(f"  {v.name:<28}{str(list(v.shape)):<20}{v.max_abs:>10.2e}{v.max_rel:>10.2e}"
                         f"{v.cosine:>10.6f}  {'ok' if v.passed else 'FAIL'}")
    first = report.first_divergence
    lines.append("\nfirst divergence: " + (f"{first[1].name} at step {first[0]} (max abs {first[1].max_abs:.2e})"
                                            if first else "none"))
    failing = sum(not v.passed for s in report.steps for v in s.values if v.name not in report.outputs)
    inside = (f"; {failing} values inside the model fail that tolerance while the outputs hold it (the engines' "
              "arithmetic differs there: the outputs are what is held)" if report.passed and failing else "")
    lines.append(f"final outputs (logits and present caches, every step), each held to |{b} - {a}| <= {atol:g} + "
                 f"{rtol:g} * |{a}|: {'PASS' if report.passed else 'FAIL'}{inside}")
    return "\n".join(lines)


def layer_growth(report: DiffReport, num_layers: int, step: int = 0) -> str:
    """How the disagreement of the residual stream grows layer by layer (one step)."""
    values = {v.name: v for v in report.steps[step].values}
    rows = ["layer  max abs (layers.i.out)    rel L2   1 - cosine"]
    for i in range(num_layers):
        v = values.get(f"layers.{i}.out")
        if v is not None:
            rows.append(f"{i:>5}  {v.max_abs:>22.3e}  {v.rel_l2:>8.2e}  {1 - v.cosine:>10.2e}")
    return "\n".join(rows)
