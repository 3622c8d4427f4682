"""The server's KV memory planned at startup (runtime/serve/plan.py): each slot's context the longest whose caches fit
a share of the free memory, up to the model's; a cache that cannot fit refused (planned) or warned of (asked); the
plan stated in the startup line."""

import pytest

from llgraph.config import LlamaConfig
from llgraph.errors import RequestError
from llgraph.kv_cache import kv_format
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.serve import plan as planning

GB = 10**9


class Shaped(Backend):
    """A backend of the 8B's cache shape (32 layers x 8 kv heads x 128), nothing else."""

    def __init__(self, kv: str, limit: int | None = 131072, max_seq_len: int = 2048):
        self.config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                  num_heads=32, num_kv_heads=8)
        self.kv, self.context_limit, self.max_seq_len = kv_format(kv), limit, max_seq_len

    def allocate(self, batch, zeroed=False):  # the plan is made before any cache exists
        raise AssertionError("planning allocates nothing")

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        raise AssertionError("planning runs nothing")


@pytest.fixture
def free(monkeypatch):
    def set_free(nbytes):
        monkeypatch.setattr(planning, "free_bytes", lambda: nbytes)
    return set_free


def test_each_slots_context_is_the_longest_that_fits(free):
    """8 slots of the 8B in int8 (67,584 bytes a token) with 19 GB free: 0.6 x 19 GB / 8 / 67,584 = 21,085 tokens,
    down to a multiple of 256; in float16 (131,072 bytes) half as long; a model of 8k positions stops at 8k."""
    free(19 * GB)
    int8, f16, short = Shaped("int8"), Shaped("f16"), Shaped("int8", limit=8192)
    for b in (int8, f16, short):
        planning.plan([b], 8, None)
    assert int8.kv_bytes_per_token() == 67584
    assert int8.max_seq_len == 0.6 * 19 * GB // (8 * 67584) // 256 * 256 == 20992
    assert f16.max_seq_len == 0.6 * 19 * GB // (8 * 131072) // 256 * 256 == 10752
    assert short.max_seq_len == 8192
    said = planning.memory(int8, 8)
    print("startup:", said)
    assert said == f" x 20992 tokens (KV cache {8 * 20992 * 67584 / GB:.2f} GB int8, planned from 19.0 GB free)"


def test_a_draft_models_cache_shares_the_plan(free):
    free(19 * GB)
    target, draft = Shaped("int8"), Shaped("int8")
    planning.plan([target, draft], 8, None)
    assert target.max_seq_len == draft.max_seq_len == 0.6 * 19 * GB // (8 * 2 * 67584) // 256 * 256


def test_slots_that_cannot_fit_are_refused_and_an_asked_length_warned_of(free, capsys):
    free(1 * GB)
    with pytest.raises(RequestError, match="lower --slots, use --kv-cache int8"):
        planning.plan([Shaped("f32")], 64, None)
    asked = Shaped("f32", max_seq_len=384)  # 8 x 384 x 262,144 bytes = 0.81 GB: beyond the 60% share, within 1 GB
    planning.plan([asked], 8, 384)
    assert asked.max_seq_len == 384  # as asked, and said
    assert "may run out of memory" in capsys.readouterr().err
    # beyond all the memory free (64 slots x 8192 f32 of the 8B: 4.4 TB here; 24.2 GB of SmolLM2 on 23 GB before):
    # refused, where it used to start with a warning
    with pytest.raises(RequestError, match="more than the 1.0 GB free besides the weights; lower --slots"):
        planning.plan([Shaped("f32", max_seq_len=8192)], 64, 8192)


def test_an_engine_of_fixed_length_is_left_as_built(free):
    free(100 * GB)
    fixed = Shaped("f16", limit=None, max_seq_len=4096)
    planning.plan([fixed], 8, None)
    assert fixed.max_seq_len == 4096
