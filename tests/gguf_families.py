"""The families as llama.cpp's own converter writes them: tiny random checkpoints made by transformers' classes
(tests/core/test_families.py's hf_checkpoint), converted by `convert_hf_to_gguf.py` vendored in llama-cpp-python's
sdist (float32, the vocabulary step skipped), both kept in tests/data/gguf_families/<family>/ (hf/, model.gguf).

    python tests/gguf_families.py PATH/TO/llama.cpp     # regenerates them (pip download --no-deps --no-binary
                                                        # :all: llama-cpp-python; its vendor/llama.cpp)
"""

import json
import shutil
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "gguf_families"
# real models' choices the GGUF cannot say otherwise: query_pre_attn_scalar = head_dim (llama.cpp assumes it below
# 27B), Gemma 3's five local layers to a global one
MADE = {"gemma2": {"query_pre_attn_scalar": 16}, "phi3": {}, "olmo2": {},
        "gemma3": {"num_hidden_layers": 7, "query_pre_attn_scalar": 16, "layer_types": None}}


def convert(llama_cpp: Path, hf: Path, out: Path) -> None:
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf as c

    cls = c.get_model_class(c.ModelBase.load_hparams(hf, False)["architectures"][0])
    cls.set_vocab = lambda self: None  # token ids only
    c_model = cls(hf, c.gguf.LlamaFileType.ALL_F32, out, model_name=hf.parent.name)
    c_model.write()


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here / "core")]
    from test_families import hf_checkpoint

    for family, overrides in MADE.items():
        folder = DATA / family
        shutil.rmtree(folder, ignore_errors=True)
        hf_checkpoint(family, folder / "hf", **overrides)
        (folder / "hf" / "generation_config.json").unlink(missing_ok=True)
        vocab = {"model": {"vocab": {f"t{i}": i for i in range(97)}}, "added_tokens": []}  # Gemma 3's row count
        (folder / "hf" / "tokenizer.json").write_text(json.dumps(vocab))
        convert(Path(sys.argv[1]), folder / "hf", folder / "model.gguf")
        (folder / "hf" / "tokenizer.json").unlink()
        print(f"wrote {folder}")
