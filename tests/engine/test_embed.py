"""Embeddings (runtime/engine/embed.py), held to transformers' `last_hidden_state` of the same weights: a tiny Llama
on ONNX Runtime and on the torch executor (last-token and mean pooling, normalised or not), and the bundled SmolLM2
on its default export (the GGUF's Q4_1 blocks on llgraph's CPU kernels) against transformers reading the GGUF."""

import numpy as np
import pytest
import torch
from conftest import need

transformers = need("transformers")

from test_families import DIMS  # noqa: E402

from llgraph.errors import RequestError  # noqa: E402
from llgraph.weight_request import Weights  # noqa: E402

TOL = 1e-4
TEXTS = [[5, 17, 42, 8, 77], [9, 3], [60, 21, 33, 4, 90, 11, 2]]


def _reference(hidden: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    v = hidden[-1] if pooling == "last" else hidden.mean(0)
    return v / np.linalg.norm(v) if normalize else v


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embed-base")
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DIMS)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
        model.save_pretrained(folder)
        hidden = [model.model(torch.tensor([t])).last_hidden_state[0].double().numpy() for t in TEXTS]
    return folder, hidden


@pytest.mark.parametrize("backend", ["ort", "ort-llgraph", "torch"])
@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("last", False)])
def test_embeddings_equal_transformers_last_hidden_state(tiny, backend, pooling, normalize, report):
    """Four times the texts (12, more than one step's EMBED_ROWS, so rows are reused), each equal to transformers;
    on contiguous rows (ort) and ragged ones (ort-llgraph, torch)."""
    from llgraph.runtime import open_runner

    folder, hidden = tiny
    def opened():
        if backend == "ort-llgraph":  # an export on llgraph's kernels: ragged rows, one packed forward a step
            return open_runner(str(folder), "ort", max_seq_len=32, weights=Weights(kernels="llgraph"),
                               kv_cache="float32")
        return open_runner(str(folder), backend, max_seq_len=32)  # ort: ONNX Runtime's own ops, contiguous rows

    runner = opened()
    assert runner.backend.ragged == (backend != "ort")
    ours = runner.embed(TEXTS * 4, pooling=pooling, normalize=normalize)
    want = np.stack([_reference(h, pooling, normalize) for h in hidden] * 4)
    report(f"{backend} {pooling} pooling{' normalised' if normalize else ''} vs transformers, 12 texts",
           float(np.abs(ours - want).max()), TOL)
    assert ours.shape == (12, DIMS["hidden_size"]) and ours.dtype == np.float32
    ours = ours[:3]
    assert np.allclose(runner.embed(TEXTS[1], pooling=pooling, normalize=normalize), ours[1], atol=1e-6)
    # generating after embedding is unchanged: the embedding's cache row is rewritten by the next prompt
    assert runner.generate(TEXTS[0], 4).token_ids == opened().generate(TEXTS[0], 4).token_ids


def test_bad_embedding_requests_are_one_line(tiny):
    from llgraph.runtime import open_runner

    runner = open_runner(str(tiny[0]), "ort", max_seq_len=8)
    with pytest.raises(RequestError, match="pooling"):
        runner.embed([1, 2], pooling="max")
    with pytest.raises(RequestError, match="exceeds the cache"):
        runner.embed(list(range(3, 20)))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        runner.embed([1, 10_000])


def test_smollm2_on_its_default_export_equals_transformers(smollm2_export, smollm2_transformers, report):
    from llgraph.runtime import ORTRunner

    runner = ORTRunner(smollm2_export("ort", quantized=True, kernels="llgraph"), max_seq_len=64)
    texts = ["The capital of France is Paris.", "A cat sat on the mat.", "Embeddings map text to vectors."]
    model = smollm2_transformers[0].model  # the decoder under the head: its last_hidden_state is normed
    with torch.no_grad():
        hidden = [model(torch.tensor([runner.encode(t)])).last_hidden_state[0].double().numpy() for t in texts]
    for pooling in ("last", "mean"):
        ours = runner.embed(texts, pooling=pooling)
        want = np.stack([_reference(h, pooling, True) for h in hidden])
        cosine = float((ours * want).sum(1).min())
        report(f"SmolLM2 Q4_1 kernels, {pooling} pooling, unit vectors vs transformers (min cosine {cosine:.6f})",
               float(np.abs(ours - want).max()), 1e-3)
    similar = runner.embed(["The capital of France is Paris.", "Paris is the capital of France.",
                            "Photosynthesis needs light."], pooling="mean")
    assert similar[0] @ similar[1] > similar[0] @ similar[2]  # a paraphrase is nearer than an unrelated text
