"""A seeded answer depends on nothing but its request (issue 48): on SmolLM2 over llgraph's CPU kernels, in each KV
cache format, the same seeded, sampled request gives the same tokens alone, after a request that wrote its prefix
(prefix reuse), written in chunks, and beside seven others; `n`-style seeds equal solo requests with those seeds; a
scored prompt's log-probabilities are the same bits fresh or after its prefix was cached. The kernels' own test
(tests/plugins/test_cpu_batch_invariance.py) holds the bits under every block type and instruction set."""

import pytest

from llgraph.runtime.backends.ort import ORTRunner
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.scheduler import Scheduler

SYSTEM = "You are a helpful assistant. You answer every question in one or two short sentences. "
QUESTIONS = ("Tell me about cats.", "Why is the sky blue?", "Name a prime number.", "What is rain?",
             "Who wrote Hamlet?", "How do birds fly?", "What is a river?", "Why do we sleep?")
SAMPLED = dict(temperature=1.0, seed=0)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_a_seeded_answer_is_the_same_alone_after_prefix_reuse_in_chunks_and_beside_others(smollm2_export, kv):
    runner = ORTRunner(smollm2_export("ort", quantized=True), kv_cache=kv)
    prompts = [SYSTEM + q for q in QUESTIONS]
    solo = [runner.generate(p, 24, **SAMPLED).token_ids for p in prompts]  # each alone in a fresh cache
    seeds = [runner.generate(prompts[0], 24, temperature=1.0, seed=s).token_ids for s in (1, 2)]
    scheduler = Scheduler(runner, slots=8, prefill_chunk=7).start()
    try:
        def one(prompt, seed=0):
            return scheduler.submit(prompt, 24, Sampling(temperature=1.0, seed=seed)).result(timeout=120).tokens

        after_prefix = [one(p) for p in prompts]  # each after the one before wrote the shared system prompt
        again = [one(p) for p in prompts[:2]]  # its own prompt cached whole
        handles = [scheduler.submit(p, 24, Sampling(temperature=1.0, seed=0)) for p in prompts]  # 8 at once
        together = [h.result(timeout=120).tokens for h in handles]
        seeded = [one(prompts[0], s) for s in (1, 2)]
    finally:
        scheduler.stop()
    for name, got in (("after a shared prefix (chunks of 7)", after_prefix), ("its prompt cached", again),
                      ("beside 7 others", together), ("seeds 1 and 2", seeded)):
        want = seeds if name == "seeds 1 and 2" else solo[:len(got)]
        differing = sum(a != b for a, b in zip(got, want))
        print(f"kv {kv}: {name}: {differing} of {len(got)} answers differ from their solo run")
        assert got == want, name


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_prompt_logprobs_are_the_same_fresh_or_after_their_prefix_was_cached(smollm2_export, kv):
    runner = ORTRunner(smollm2_export("ort", quantized=True), kv_cache=kv)
    prompt = SYSTEM + QUESTIONS[1]
    scheduler = Scheduler(runner, slots=2, prefill_chunk=7).start()
    try:
        def scored():
            handle = scheduler.submit(prompt, 0, prompt_logprobs=True)
            handle.result(timeout=120)
            return [(s.token, s.logprob) for s in handle.prompt_logprobs]

        fresh = scored()
        scheduler.submit(SYSTEM + QUESTIONS[0], 4).result(timeout=120)  # the system prompt into another row
        reused = scored()
    finally:
        scheduler.stop()
    worst = max(abs(a[1] - b[1]) for a, b in zip(fresh, reused))
    print(f"kv {kv}: prompt logprobs, fresh vs after reuse: max|diff| = {worst:.3e}")
    assert reused == fresh


@pytest.mark.parametrize("experts", ["float", "K-quants"])
def test_a_moe_row_s_experts_do_not_depend_on_its_neighbours(experts, tmp_path):
    """llama.cpp's Qwen3-MoE GGUF (tests/data/gguf_families; and tests/kquant_moe.py's, its experts Q4_K/Q5_K/Q6_K
    on llgraph's MoE kernel): four seeded, sampled requests give the same tokens each alone and packed together in
    the scheduler's steps (prompts written in chunks of 5): the router and the experts a row's tokens take are its
    own."""
    from gguf_families import DATA
    from kquant_moe import write

    from llgraph.runtime import open_runner

    path = DATA / "qwen3_moe" / "model.gguf" if experts == "float" else write(tmp_path / "q.gguf")
    runner = open_runner(str(path), "ort", max_seq_len=64, cache_dir=str(tmp_path))
    prompts = [[5, 17, 33, 8, 61, 42, 9, 11, 70], [3, 4, 5, 6], [80, 81, 82, 83, 84, 85, 86], [7] * 12]
    solo = [runner.generate(p, 16, temperature=1.0, seed=0, eos_token_ids=[]).token_ids for p in prompts]
    scheduler = Scheduler(runner, slots=4, prefill_chunk=5).start()
    try:
        handles = [scheduler.submit(p, 16, Sampling(temperature=1.0, seed=0), eos_token_ids=[]) for p in prompts]
        together = [h.result(timeout=120).tokens for h in handles]
    finally:
        scheduler.stop()
    print("alone:", solo, "\ntogether:", together)
    assert together == solo
