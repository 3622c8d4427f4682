"""Where a decode step's time goes: ONNX Runtime's own profiler over export folders (llgraph's `ort` exports, or
onnxruntime-genai's), the summed kernel time of each op type in ms per step, beside each folder's wall time a step.

    python -m llgraph.runtime.bench.step_profile FOLDER [FOLDER ...] [--threads 2] [--past 64] [--cache 256]
                                                 [--steps 50] [--rows 1]

Each folder's model.onnx runs one-token steps after `--past` cached positions (zeros: a step's cost does not depend
on the values), with llgraph's kernel library registered where the folder carries it. The cache: llgraph's static
buffer of `--cache` positions, bound as both past and present (as OrtBackend runs it), or genai's `past` positions
(its head size from the folder's genai_config.json). `--rows` N > 1: N rows' decode tokens packed into one forward,
as the server's step runs N streams. Then the profiled session's GroupedAttention time grows with `--cache` (16
rows: 2.9 ms a step at 128 positions, 40 ms at 1,024) while the unprofiled wall time does not (144 ms both): under
ONNX Runtime's profiler the in-place cache is copied; read the wall time."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from llgraph.passes import SLOTS_INPUT


def session(folder: Path, threads: int, trace_dir: str | None = None):
    """An ONNX Runtime session of the folder's graph; with `trace_dir`, profiling into it (never into the folder)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.log_severity_level = threads, 3
    if trace_dir is not None:
        opts.enable_profiling, opts.profile_file_prefix = True, str(Path(trace_dir) / "step")
    library = folder / "libllgraph_ort.so"
    if library.exists():
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])


def feeds(sess, folder: Path, past: int, cache: int, rows: int = 1) -> dict:
    """One decode step's inputs after `past` cached positions, by input name (llgraph's or genai's); `rows` > 1:
    that many rows' decode tokens packed into one forward, each in its own cache row (a ragged export's slot_ids),
    as the server's step runs `rows` streams."""
    head = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    names = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    if rows > 1 and SLOTS_INPUT not in names:
        raise SystemExit(f"--rows {rows} needs a ragged export (slot_ids: --kernels llgraph); {folder} has none")
    out = {SLOTS_INPUT: np.arange(rows, dtype=np.int64)} if rows > 1 else {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            out[i.name] = np.full((1, rows), 5, np.int64)
        elif i.name == "position_ids":
            out[i.name] = np.full((1, rows), past, np.int64)
        elif i.name == "attention_mask":
            out[i.name] = np.ones((1, past + 1), np.int64)
        elif i.name.startswith("past_key_values"):
            dims = [rows if d in ("batch", "batch_size", "cache_rows") else cache if d == "max_seq" else past
                    if d == "past_sequence_length" else head if d == "kv_cache_dim" else d for d in i.shape]
            out[i.name] = np.zeros(dims, np.float16 if "float16" in i.type else np.float32)
    return out


def stepper(sess, inputs: dict):
    """One step's run: a static cache (llgraph's) is bound as both past and present, written in place as
    OrtBackend binds it (session.run would copy every cache buffer each step); genai's grows by copy, as it runs."""
    import onnxruntime as ort

    if not any(i.name.startswith("past_key_values") and "max_seq" in i.shape for i in sess.get_inputs()):
        return lambda: sess.run(["logits"], inputs)
    binding = sess.io_binding()
    for name, value in inputs.items():
        if name.startswith("past_key_values"):
            shared = ort.OrtValue.ortvalue_from_numpy(value)
            binding.bind_ortvalue_input(name, shared)
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), shared)
        elif name == SLOTS_INPUT:  # an overridable initializer: bind_cpu_input looks among the required inputs
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        else:
            binding.bind_cpu_input(name, value)
    binding.bind_output("logits")
    return lambda: sess.run_with_iobinding(binding)


def profile(folder: Path, threads: int, past: int, cache: int, steps: int, rows: int = 1
            ) -> tuple[dict[str, float], float, dict[str, float]]:
    """(op type -> kernel ms per step, wall ms per step, node -> kernel ms per step) of one folder."""
    timed = session(folder, threads)
    run = stepper(timed, feeds(timed, folder, past, cache, rows))
    for _ in range(5):
        run()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    wall = (time.perf_counter() - start) / steps * 1e3
    with tempfile.TemporaryDirectory() as trace_dir:
        profiled = session(folder, threads, trace_dir)
        run = stepper(profiled, feeds(profiled, folder, past, cache, rows))
        for _ in range(5 + steps):
            run()
        events = json.loads(Path(profiled.end_profiling()).read_text())
    per_op: dict[str, float] = {}
    per_node: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op, ms = event["args"]["op_name"], event["dur"] / 1e3 / (5 + steps)
            per_op[op] = per_op.get(op, 0.0) + ms
            node = f'{op} {event["name"].removesuffix("_kernel_time")}'
            per_node[node] = per_node.get(node, 0.0) + ms
    return per_op, wall, per_node


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--past", type=int, default=64, help="cached positions before the step (default 64)")
    p.add_argument("--cache", type=int, default=256, help="llgraph's static cache length (default 256)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rows", type=int, default=1, help="rows decoding, packed into one forward (default 1)")
    p.add_argument("--nodes", type=int, default=5, help="each folder's costliest nodes to list (default 5)")
    args = p.parse_args(argv)
    results = {f.name: profile(f, args.threads, args.past, args.cache, args.steps, args.rows) for f in args.folders}
    ops = sorted({op for per_op, _, _ in results.values() for op in per_op},
                 key=lambda op: -max(per_op.get(op, 0.0) for per_op, _, _ in results.values()))
    names = list(results)
    print(f"ms per step of {args.rows} row(s) of one token after {args.past} cached positions, {args.threads} "
          f"threads, {args.steps} steps")
    print(f"{'op':<28}" + "".join(f"{n[:30]:>32}" for n in names))
    for op in ops:
        print(f"{op:<28}" + "".join(f"{results[n][0].get(op, 0.0):>32.3f}" for n in names))
    print(f"{'kernels, summed':<28}" + "".join(f"{sum(results[n][0].values()):>32.3f}" for n in names))
    print(f"{'wall a step (no profiler)':<28}" + "".join(f"{results[n][1]:>32.3f}" for n in names))
    for n in names:
        print(f"\n{n}: its {args.nodes} costliest nodes, ms per step")
        for node, ms in sorted(results[n][2].items(), key=lambda kv: -kv[1])[:args.nodes]:
            print(f"  {ms:8.3f}  {node}")


if __name__ == "__main__":
    main()
