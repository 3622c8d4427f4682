"""A third-party runtime loads our artifact: onnxruntime-genai runs the `ort` export of SmolLM2 unchanged (its own
tokenizer, cache and loop), and its 32 greedy tokens equal the PyTorch executor's."""

import pytest
import torch
from reference import Stepper

from llgraph.checkpoint import load_config
from llgraph.export import export_model
from llgraph.weights import SafetensorsSource

pytestmark = pytest.mark.slow
og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[test]')")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from llgraph.export.benchmark import make_hf_folder

    return make_hf_folder(tmp_path_factory.mktemp("smollm2-hf"))


def test_onnxruntime_genai_runs_the_export(hf_folder, tmp_path):
    folder = export_model(hf_folder, checkpoint=hf_folder, out=tmp_path / "ort", target="ort", max_seq_len=512)
    assert (folder / "genai_config.json").exists() and (folder / "tokenizer.json").exists()
    model = og.Model(str(folder))
    prompt = [int(t) for t in og.Tokenizer(model).encode("Once upon a time, in a small village by the sea, there")]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + NEW_TOKENS, do_sample=False, top_k=1)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    theirs = []
    while not generator.is_done():
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))

    cfg = load_config(hf_folder)
    stepper, ids, ours = Stepper(cfg, SafetensorsSource(hf_folder), max_seq=128), torch.tensor([prompt]), []
    for _ in range(NEW_TOKENS):
        ours.append(int(stepper.step(ids)["logits"][0, -1].argmax()))
        ids = torch.tensor([[ours[-1]]])
    print(f"genai: {theirs}\nours:  {ours}")
    assert len(theirs) == NEW_TOKENS and theirs == ours
