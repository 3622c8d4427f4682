"""The sampling a model recommends (llgraph/generation_config.py): an HF folder's generation_config.json, a GGUF's
general.sampling.* keys as llama.cpp's converter writes them (gguf's own writer here), carried into an export, and
llama-server's defaults for whatever the model leaves unnamed."""

import json

from gguf_vocab import SENTENCEPIECE, with_weights

from llgraph.generation_config import LLAMA_SERVER, of_gguf, recommended
from llgraph.gguf_source import gguf_reader


def test_a_folder_s_generation_config_over_llama_server_s(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": -1, "min_p": None, "eos_token_id": 2}))
    r = recommended(tmp_path)
    print(r.describe())
    assert r.values == {**LLAMA_SERVER, "temperature": 0.6, "top_p": 0.9, "top_k": 0}  # vLLM's -1: off
    assert r.source["temperature"] == "generation_config.json" and r.source["min_p"] == "llama-server"
    assert recommended(tmp_path / "nowhere").values == LLAMA_SERVER == recommended(None).values
    (tmp_path / "generation_config.json").write_text("{not json")
    assert recommended(tmp_path).values == LLAMA_SERVER  # an unreadable file is no recommendation


def test_a_gguf_s_sampling_keys_and_their_way_into_an_export(tmp_path):
    from llgraph.export import export_model

    model = with_weights(tmp_path / "model.gguf", SENTENCEPIECE["spm"], {"temp": 0.7, "top_k": 20, "min_p": 0.1})
    own = of_gguf(gguf_reader(model))
    assert own.keys() == {"temperature", "top_k", "min_p"} and abs(own["temperature"] - 0.7) < 1e-6
    assert own["top_k"] == 20 and isinstance(own["top_k"], int)
    # the export holds them as generation_config.json: a runner opened on the folder reads them there
    folder = export_model(str(model), checkpoint=str(model), out=tmp_path / "out", target="ort")
    got = recommended(folder)
    print(got.describe())
    assert got.values["top_k"] == 20 and abs(got.values["temperature"] - 0.7) < 1e-6
    assert got.values["top_p"] == LLAMA_SERVER["top_p"] and got.source["top_k"] == "generation_config.json"
