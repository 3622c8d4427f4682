"""A third-party runtime loads our artifact: onnxruntime-genai runs the `ort` export of SmolLM2 unchanged (its own
tokenizer, cache and loop), and its 32 greedy tokens equal the PyTorch executor's."""

import shutil

import pytest
import torch
from conftest import need
from reference import Stepper

from llgraph.checkpoint import load_config
from llgraph.export import export_model
from llgraph.weights import SafetensorsSource

pytestmark = pytest.mark.slow
og = need("onnxruntime_genai")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from llgraph.runtime.bench.export_speed import make_hf_folder

    folder = make_hf_folder(tmp_path_factory.mktemp("smollm2-hf"))
    yield folder
    shutil.rmtree(folder)  # 0.53 GB of float32 safetensors the rest of the session does not read


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


def test_llgraph_convert_makes_a_folder_that_answers_as_the_gguf(hf_folder, tmp_path):
    """`llgraph convert` (export/convert.py; the fixture above made the folder through it): the HF folder's logits on
    the torch executor equal the GGUF's own, dequantized; a path that is not a GGUF is one line."""
    import subprocess
    import sys

    import numpy as np

    from llgraph.runtime import open_runner

    ids = np.array([[1, 504, 3458, 314, 253, 2010, 28, 359]], np.int64)
    logits = []
    for model in ("smollm2", str(hf_folder)):
        runner = open_runner(model, "torch", max_seq_len=32)
        runner.backend.allocate(1)
        logits.append(np.asarray(runner.backend.forward(ids, np.arange(ids.shape[1])[None]), np.float64))
    diff = float(np.abs(logits[0] - logits[1]).max())
    print(f"converted HF folder vs the GGUF, torch executor: max |logit diff| {diff:.2e}")
    assert diff < 1e-3
    r = subprocess.run([sys.executable, "-m", "llgraph", "convert", str(hf_folder / "config.json"), "-o",
                        str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a GGUF file" in r.stderr and not (tmp_path / "x").exists(), r.stderr
