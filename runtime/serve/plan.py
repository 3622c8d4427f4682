"""The server's KV memory, planned at startup rather than discovered when the slots fill: without --max-seq-len, each
slot's context is the longest that lets every slot's cache fit a share of the memory free once the model is loaded
(up to the model's own context); with it, a cache beyond that share is warned of at startup, and one beyond the
memory free is refused. The plan is stated in the
startup line ("8 slots x 16384 tokens (KV cache 8.86 GB int8, planned from 19.4 GB free)") and /metrics shows the
cache's bytes in use.

The cache is allocated zeroed (calloc: pages are taken as positions are written), so a long context costs memory
only as requests fill it; the plan makes sure that all slots full still fit.

Measured here (24 GB, the 8B's 4.4 GB of weights): `llgraph serve 8b.gguf --kv-cache int8` says "8 slots x 8192
tokens (KV cache 4.43 GB int8, planned from 24.5 GB free)", the GGUF's context being 8k; 8 slots x 8k or one 32k
stream fit in int8 (67,584 bytes a token: 4.4 GB, 2.2 GB) or f16 (8.6 GB, 4.3 GB). One 32k stream in int8
(`python -m llgraph.runtime.bench.long_context MODEL --context 32768 --synthetic`, an export with
`--max-seq-len 32768`) peaks at 6.7 GB resident and decodes at 2.0-2.5 tok/s at that depth. A request that cannot
fit its slot is a 400 naming the context.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llgraph.errors import RequestError

KV_SHARE = 0.6  # of the memory free after loading: the rest for activations, logits, the OS and other processes
STEP = 256  # a planned context is a multiple of this


def free_bytes() -> int | None:
    """The memory the kernel says is available for new allocations (MemAvailable), or None off Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mapped_weight_bytes(backend) -> int:
    """An export's weight files (memory-mapped: the page cache holding them counts as available, yet they stay)."""
    folder = backend.folder
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file()) if folder else 0


def plan(backends: list, slots: int, asked: int | None) -> None:
    """Sets each backend's max_seq_len (a model and its draft model, before their caches are allocated) when `asked`
    is None and they can choose; the first backend's `kv_plan` says how (memory() adds it to the statement). An
    asked length whose caches would not fit is a warning."""
    backend = backends[0]
    free = free_bytes()
    limits = [b.context_limit for b in backends]

    def need(tokens: int) -> int:  # every slot's row of a `tokens`-position cache (windowed layers' rings)
        return slots * sum(b.kv_row_bytes(tokens) for b in backends)
    if not need(1) or free is None:
        return
    budget = KV_SHARE * max(0, free - sum(mapped_weight_bytes(b) for b in backends))
    if asked is not None or None in limits:
        total = need(backend.max_seq_len)
        room = free - sum(mapped_weight_bytes(b) for b in backends)
        if asked is not None and None not in limits and total > room:  # a host cache that cannot fit even alone
            raise RequestError(f"{slots} slots x {backend.max_seq_len} tokens need {total / 1e9:.2f} GB of KV cache "
                               f"({backend.kv_format().name}), more than the {max(room, 0) / 1e9:.1f} GB free besides "
                               "the weights; lower --slots or --max-seq-len, or use --kv-cache int8")
        if total > budget:
            print(f"llgraph serve: warning: {slots} slots x {backend.max_seq_len} tokens need {total / 1e9:.2f} GB of "
                  f"KV cache, more than {KV_SHARE:.0%} of the {free / 1e9:.1f} GB free; when the slots fill the "
                  "server may run out of memory (lower --slots or --max-seq-len, or --kv-cache int8)",
                  file=sys.stderr, flush=True)
        return
    longest = min(limits)
    top = longest // STEP  # the most STEPs that fit (the need grows with the length)
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid * STEP) <= budget else (lo, mid - 1)
    tokens = longest if lo == top and need(longest) <= budget else lo * STEP
    if tokens < STEP:
        raise RequestError(f"{slots} slots of even {STEP} tokens need {need(STEP) / 1e9:.2f} GB of KV "
                           f"cache ({backend.kv_format().name}), more than {KV_SHARE:.0%} of the {free / 1e9:.1f} GB "
                           "free; lower --slots, use --kv-cache int8, or free memory")
    for b in backends:
        b.max_seq_len = tokens
    backend.kv_plan = f", planned from {free / 1e9:.1f} GB free"


def memory(backend, slots: int) -> str:
    """' x T tokens (KV cache X GB format[, planned ...])': what the server holds for its slots, said at startup."""
    row = backend.kv_row_bytes(backend.max_seq_len)
    if not row:
        return ""
    ring = backend.planned_ring(backend.max_seq_len)
    rings = f", windowed layers a ring of {ring}" if ring else ""
    return (f" x {backend.max_seq_len} tokens (KV cache {row * slots / 1e9:.2f} GB "
            f"{backend.kv_format().name}{rings}{backend.kv_plan})")
