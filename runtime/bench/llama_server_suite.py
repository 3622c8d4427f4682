"""llama.cpp's own server test suite (tools/server/tests in its source) run against `llgraph serve`, as its CI runs
llama-server: a launcher stands in for the llama-server binary (LLAMA_SERVER_BIN_PATH), reads the flags the suite
passes (host, port, context, parallel slots, alias, API key, pooling, CORS origins) and serves a local model in
their place (the suite's own models come from the Hub; its tests that check a model's words then fail for that
reason alone). Prints the suite's summary and the outcome of every test, for a list of what fails and why.

    python -m llgraph.runtime.bench.llama_server_suite LLAMA_CPP_SOURCE [FILE ...] [--model smollm2] [-k EXPR]

It needs the suite's own requirements (tools/server/tests/requirements.txt: aiohttp, openai, prometheus-client,
wget, filelock). The launcher answers any model name (`--any-model`), as llama-server does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL_ENV = "LLGRAPH_SUITE_MODEL"


def launch(argv: list[str]) -> None:
    """The stand-in llama-server: its flags -> `llgraph serve` (the process is replaced by it)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8080")
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-np", "--parallel", type=int, default=1)
    p.add_argument("-a", "--alias")
    p.add_argument("--api-key")
    p.add_argument("--pooling")
    p.add_argument("--cors-origins")
    args, _ = p.parse_known_args(argv)
    slots, model = max(1, args.parallel), os.environ.get(MODEL_ENV, "smollm2")
    per_slot = args.ctx_size // slots if args.ctx_size else 2048  # llama-server splits -c among its slots
    per_slot = min(per_slot, _positions(model))  # the suite's real models take 16k; the stand-in holds what it can
    serve = [sys.executable, "-m", "llgraph", "serve", model, "--host", args.host,
             "--port", str(args.port), "--slots", str(slots), "--max-seq-len", str(max(per_slot, 64)), "--any-model",
             "--threads", "2"]
    if args.alias:
        serve += ["--name", args.alias]
    if args.api_key:
        serve += ["--api-key", args.api_key]
    if args.pooling in ("mean", "last"):
        serve += ["--pooling", args.pooling]
    if args.cors_origins:
        serve += ["--cors-origins", *args.cors_origins.split(",")]
    os.execv(sys.executable, serve)


def _positions(model: str) -> int:
    """The positions `model` was trained for (its config's max_position_embeddings)."""
    from llgraph.bundled import resolve
    from llgraph.checkpoint import load_config

    return load_config(resolve(model)).max_position_embeddings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llgraph.runtime.bench.llama_server_suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="llama.cpp's source tree (llama-cpp-python's sdist vendors it)")
    p.add_argument("--model", default="smollm2", help="what `llgraph serve` serves in place of the suite's models")
    p.add_argument("-k", help="pytest's -k: only the tests it selects")
    p.add_argument("files", nargs="*", help="the suite's files to run (e.g. test_chat_completion.py; default all)")
    args = p.parse_args(argv)
    tests = args.source / "tools" / "server" / "tests"
    if not (tests / "unit").is_dir():
        raise SystemExit(f"{tests / 'unit'} is not there: give llama.cpp's source tree (the folder holding tools/)")
    with tempfile.TemporaryDirectory(prefix="llgraph-suite-") as scratch:
        launcher = Path(scratch) / "llama-server"
        launcher.write_text(f"#!{sys.executable}\nimport sys\nfrom llgraph.runtime.bench.llama_server_suite "
                            "import launch\nlaunch(sys.argv[1:])\n")
        launcher.chmod(0o755)
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(launcher), MODEL_ENV: args.model}
        files = [f"unit/{f}" for f in args.files] or ["unit"]
        command = [sys.executable, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", *files,
                   *(["-k", args.k] if args.k else [])]  # -v: each test's outcome as it ends
        return subprocess.run(command, cwd=tests, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
