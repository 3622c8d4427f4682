"""Gemma 3's sliding-window cache (llgraph/kv_cache.py ring_length): a local layer holds a ring of window + step - 1
slots, not every position, and a forward longer than the ring allows runs in pieces. Held to transformers'
Gemma3ForCausalLM (its own sliding-window mask, no cache) far past the window and around the ring many times, on
every backend whose attention takes a ring; then through the scheduler: prefix reuse across the window's edge,
speculation, and rows beside each other, each answer transformers' greedy one."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from test_families import hf_checkpoint

import llgraph.kv_cache as kv_cache
from llgraph.export import export_model
from llgraph.runtime.engine.scheduler import Metrics, Scheduler
from llgraph.weight_request import Weights

TOL = 1e-4
MAX_SEQ, WINDOW, RING = 96, 5, 8  # RING_STEP 4, unaligned: 5 + 4 - 1 slots for the local layer
PROMPT, STEPS = 21, 40


@pytest.fixture
def small_ring(monkeypatch):
    monkeypatch.setattr(kv_cache, "RING_STEP", 4)
    monkeypatch.setattr(kv_cache, "RING_ALIGN", 1)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    model = hf_checkpoint("gemma3", folder, max_position_embeddings=128)
    return folder, model


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (its cache) and the logits of the whole sequence in one uncached forward."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        logits = model(out).logits[0]
    return out[0].tolist(), logits


def _runner(backend: str, folder, tmp_path):
    if backend == "torch":
        from llgraph.runtime import TorchRunner

        return TorchRunner(folder, max_seq_len=MAX_SEQ)
    from llgraph.runtime import ORTRunner

    target, _, kernels = backend.partition("-")
    out = export_model(folder, checkpoint=folder, out=tmp_path / backend, target=target, max_seq_len=128,
                       weights=Weights(kernels="llgraph") if kernels else Weights())
    return ORTRunner(out, max_seq_len=MAX_SEQ, kv_cache="float32")  # (llgraph's kernels default to float16)


@pytest.mark.parametrize("backend", ["torch", "ort-kernels", "onnx"])
def test_local_layers_hold_a_ring_and_equal_transformers_past_it(backend, gemma3, small_ring, tmp_path, report):
    folder, model = gemma3
    prompt = torch.randint(3, 97, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    ids, want = hf_greedy(model, prompt, STEPS)
    runner = _runner(backend, folder, tmp_path)
    b = runner.backend
    b.allocate(1, zeroed=True)
    assert b.ring == RING
    lengths = [c.shape[2] for c in b.caches()]
    assert lengths == [RING, RING, MAX_SEQ, MAX_SEQ], lengths  # layer 0 local (key, value), layer 1 global
    assert b.kv_row_bytes(MAX_SEQ) < b.kv_bytes_per_token() * MAX_SEQ
    got = [b.forward(np.array([prompt]), np.arange(PROMPT)[None])[0]]  # 21 positions: 6 pieces of <= 4
    for at in range(PROMPT, len(ids) - 1):  # each of transformers' tokens, one step each, 40 past the prompt
        got.append(b.forward(np.array([[ids[at]]]), np.array([[at]]))[0])
    got = np.concatenate(got)
    worst = float(np.abs(got - want[:len(ids) - 1].numpy()).max())
    report(f"gemma3 on {backend} with a ring of {RING} slots (window {WINDOW}), {len(ids) - 1} positions vs "
           "transformers, logits", worst, TOL)


class Counting(Metrics):
    def __init__(self):
        self.prefills = []  # (reused, prompt tokens)

    def prefix(self, reused: int, prompt: int) -> None:
        self.prefills.append((reused, prompt))


@pytest.mark.parametrize("backend", ["torch", "ort-kernels"])
def test_reuse_speculation_and_neighbours_across_the_window_edge(backend, gemma3, small_ring, tmp_path, report):
    """A row that wrote far past a shared prefix's window cannot lend it (its ring overwrote those keys): the next
    request computes it again; a row that stopped within the ring of it lends it. Every answer is transformers'
    greedy one, whether reused, drafted (ngram speculation on a repetitive prompt) or run beside other rows."""
    folder, model = gemma3
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 97, (30,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 97, (3,), generator=gen).tolist() for _ in range(4)]
    loop = torch.randint(3, 97, (6,), generator=gen).tolist() * 5  # repetitive: ngram drafts find matches
    runner = _runner(backend, folder, tmp_path)
    metrics = Counting()
    scheduler = Scheduler(runner, slots=2, metrics=metrics).start()

    def answer(prompt, steps, **kw):  # -> [(token, its log-probability)]
        handle, got = scheduler.submit(prompt, steps, eos_token_ids=[], logprobs=0, **kw), []
        while True:
            event = handle.events.get(timeout=300)
            assert event.kind != "error", event.text
            if event.token is not None:  # (the last token comes with "done")
                got.append((event.token, event.logprob.logprob))
            if event.kind == "done":
                return got

    try:
        long = answer(prompts[0], 20)  # its row writes 20 past the shared 30: the window behind 30 is overwritten
        after_long = answer(prompts[1], 4)  # computed again (the metrics say), not read from that row
        short = answer(prompts[2], 1)  # (lands in the other row, or this one recomputed)
        reused = answer(prompts[3], 6)  # from a row that wrote at most 4 past 30: within its ring
        with ThreadPoolExecutor(2) as pool:  # two rows in one step, one drafting
            together = list(pool.map(lambda a: answer(*a[:2], **a[2]),
                                     [(prompts[0], 20, {}), (loop, 24, {"speculative": "ngram"})]))
    finally:
        scheduler.stop()
    worst = 0.0
    for prompt, steps, got in [(prompts[0], 20, long), (prompts[1], 4, after_long), (prompts[2], 1, short),
                               (prompts[3], 6, reused), (prompts[0], 20, together[0]), (loop, 24, together[1])]:
        ids, logits = hf_greedy(model, prompt, steps)
        assert [t for t, _ in got] == ids[len(prompt):], (prompt, steps)
        want = logits.double().log_softmax(-1)[len(prompt) - 1:-1].gather(1, torch.tensor(ids[len(prompt):])[:, None])
        worst = max(worst, float(np.abs(np.array([lp for _, lp in got]) - want[:, 0].numpy()).max()))
    report(f"gemma3 served on {backend}, ring of {RING}: each token's log-probability vs transformers", worst, TOL)
    print("prefills (reused, prompt):", metrics.prefills)
    assert metrics.prefills[1][0] == 0  # the long row's window is gone: nothing reused
    assert metrics.prefills[3][0] == 30  # the short row's is intact: the shared prefix reused
