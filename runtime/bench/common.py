"""What the feature benchmarks (grammar_, speculative_, prefix_benchmark) share: their command line and the runner
they time (`llgraph generate MODEL`'s default: ONNX Runtime on the export cache's entry)."""

from __future__ import annotations

import argparse


def runner_from_args(doc: str, argv=None, new_tokens: int | None = None, max_seq_len: int = 1024, extra=None):
    """--model (default smollm2), --threads (2), --repeats (5) and, given a default, --new-tokens -> (args, runner).
    `extra(parser)` adds a benchmark's own flags."""
    from llgraph.runtime.backends import open_runner

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    if new_tokens is not None:
        p.add_argument("--new-tokens", type=int, default=new_tokens)
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    if getattr(args, "draft", False):  # a model and its draft: one thread pool
        from llgraph.runtime.backends import share_threads_with_a_draft

        share_threads_with_a_draft("ort", args.threads)
    return args, open_runner(args.model, "ort", max_seq_len=max_seq_len, threads=args.threads)
