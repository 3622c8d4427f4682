"""The families as llama.cpp's own converter writes them: tiny random checkpoints made by transformers' classes
(tests/core/test_families.py's hf_checkpoint), converted by `convert_hf_to_gguf.py` vendored in llama-cpp-python's
sdist (float32, the vocabulary step skipped), both kept in tests/data/gguf_families/<family>/ (hf/, model.gguf).

    python tests/gguf_families.py PATH/TO/llama.cpp [FAMILY ...]   # regenerates them (pip download --no-deps
                                                        # --no-binary :all: llama-cpp-python; its vendor/llama.cpp)
    python tests/gguf_families.py --greedy FAMILY ...   # 16 greedy tokens from llama.cpp (llama-cpp-python) and
                                                        # llgraph on the same file, side by side
    python tests/gguf_families.py --greedy-quantized PATH/TO/llama.cpp FAMILY ...   # the same on a Q4_K_M file
                              # made by llama.cpp's own quantizer from the family at K-quant-sized shapes (QUANTIZED);
                              # where they part, both tokens' logits beside float64's (a near-tie or not)
                              # (FTYPE=38: MXFP4_MOE, gpt-oss's experts in MXFP4, as its published GGUFs)
    python tests/gguf_families.py --mxfp4 PATH/TO/llama.cpp   # tests/data/gguf_families/gpt_oss/mxfp4.gguf: the
                              # family (ffn 64, whole blocks of 32) through llama-quantize's MXFP4_MOE
"""

import json
import os
import shutil
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "gguf_families"
# real models' choices the GGUF cannot say otherwise: query_pre_attn_scalar = head_dim (llama.cpp assumes it below
# 27B), Gemma 3's five local layers to a global one
MADE = {"gemma2": {"query_pre_attn_scalar": 16}, "phi3": {}, "olmo2": {},
        "gemma3": {"num_hidden_layers": 7, "query_pre_attn_scalar": 16, "layer_types": None},
        # mixtures of experts (llama.cpp's qwen3moe, llama, olmoe); OLMoE with as many kv heads as heads, as the real
        # one: llama.cpp sizes its k-norm by the hidden size
        "qwen3_moe": {}, "mixtral": {}, "olmoe": {"num_key_value_heads": 4}, "qwen2_moe": {},
        # llama.cpp's YaRN cuts its ramp at whole dimensions (ggml_rope_yarn_corr_dims' floor and ceil), which is
        # transformers' truncate; the GGUF cannot say otherwise
        "gpt_oss": {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": True, "original_max_position_embeddings": 4096,
                                        "rope_theta": 150000.0}}}


# shapes whose every expert row is whole 256-weight super-blocks, so llama.cpp's Q4_K_M quantizer writes the
# experts in Q4_K and Q6_K rather than its fallback types
QUANTIZED = {"qwen3_moe": {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
                           "head_dim": 64, "num_experts": 8},
             "mixtral": {"hidden_size": 256, "intermediate_size": 256, "num_local_experts": 8},
             "olmoe": {"hidden_size": 256, "intermediate_size": 256, "num_experts": 8},
             "qwen2_moe": {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
                           "shared_expert_intermediate_size": 256, "num_experts": 8},
             "gpt_oss": {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "num_local_experts": 8}}
STD = float(os.environ.get("STD", 0.3))


def convert(llama_cpp: Path, hf: Path, out: Path) -> None:
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf as c

    cls = c.get_model_class(c.ModelBase.load_hparams(hf, False)["architectures"][0])
    cls.set_vocab = lambda self: None  # token ids only
    c_model = cls(hf, c.gguf.LlamaFileType.ALL_F32, out, model_name=hf.parent.name)
    c_model.write()


def with_vocabulary(src: Path, dst: Path, n: int = 97) -> Path:
    """`src` with a placeholder vocabulary of n pieces: llama.cpp loads no GGUF without one."""
    import gguf
    import numpy as np
    from reference import copying_fields

    r = gguf.GGUFReader(str(src))
    w = copying_fields(r, dst)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([1] * n)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


PROMPT = (5, 17, 33, 8, 61, 42, 9, 11, 70)


def greedy(family: str | Path, prompt=PROMPT, steps: int = 16) -> tuple[list, list]:
    """(llama.cpp's, llgraph's ort) greedy tokens after `prompt` on the family's GGUF (or the GGUF at a path)."""
    path = family if isinstance(family, Path) else DATA / family / "model.gguf"
    import tempfile

    import numpy as np
    from llama_cpp import Llama

    from llgraph.runtime import open_runner

    with tempfile.TemporaryDirectory() as tmp:
        llm = Llama(str(with_vocabulary(path, Path(tmp) / "v.gguf")), n_ctx=64,
                    verbose=False, logits_all=True)
        llm.eval(list(prompt))
        theirs = []
        for _ in range(steps):
            theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([theirs[-1]])
        runner = open_runner(str(path), "ort", max_seq_len=64, cache_dir=tmp)
        return theirs, runner.generate(list(prompt), steps, eos_token_ids=[]).token_ids


def near_tie(path: Path, prompt, theirs: list, ours: list) -> str:
    """At the first position where the two engines' greedy tokens part: both tokens' logits from llama.cpp, from
    llgraph, and from float64 on gguf's dequantization of the same file (tests/reference.py's Stepper), and each
    engine's largest logit error from float64 there — a near-tie when float64's gap is inside those errors."""
    import tempfile

    import numpy as np
    import torch
    from llama_cpp import Llama
    from reference import Stepper

    from llgraph.checkpoint import load_config
    from llgraph.gguf_source import GGUFSource
    from llgraph.runtime import open_runner
    from llgraph.runtime.engine.packed import step_logits

    i = next(j for j, (a, b) in enumerate(zip(theirs, ours)) if a != b)
    context, (a, b) = list(prompt) + theirs[:i], (theirs[i], ours[i])
    with tempfile.TemporaryDirectory() as tmp:
        llm = Llama(str(with_vocabulary(path, Path(tmp) / "v.gguf")), n_ctx=64, verbose=False, logits_all=True)
        llm.eval(context)
        cpp = np.array(llm.scores[llm.n_tokens - 1], np.float64)
        runner = open_runner(str(path), "ort", max_seq_len=64, cache_dir=tmp)
        runner.backend.allocate(1)
        mine = np.asarray(step_logits(runner.backend, context, 0)[-1], np.float64)
    truth = Stepper(load_config(path), GGUFSource(path), dtype="float64").step(torch.tensor([context]))
    f64 = truth["logits"][0, -1].numpy()
    return (f"first parting at token {i}: float64 {a}: {f64[a]:.5f}, {b}: {f64[b]:.5f} (gap {f64[a] - f64[b]:+.5f}); "
            f"llama.cpp {cpp[a] - cpp[b]:+.5f} (its max error {np.abs(cpp - f64).max():.5f}); llgraph "
            f"{mine[a] - mine[b]:+.5f} (its max error {np.abs(mine - f64).max():.5f})")


def quantized(family: str, source: Path, folder: Path, ftype: int = 15) -> Path:
    """The family at QUANTIZED's shapes, converted by llama.cpp's converter (float32), then quantized by llama.cpp's
    own quantizer (llama-cpp-python's llama_model_quantize; ftype 15: Q4_K_M) -> its path."""
    import ctypes

    from llama_cpp import llama_model_quantize, llama_model_quantize_default_params

    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here / "core"), str(here / "export")]
    from test_families import hf_checkpoint

    hf_checkpoint(family, folder / "hf", std=STD, **{**MADE[family], **QUANTIZED[family]})
    (folder / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(97)}},
                                                              "added_tokens": []}))
    convert(source, folder / "hf", folder / "f32.gguf")
    with_vocabulary(folder / "f32.gguf", folder / "f32v.gguf")
    params = llama_model_quantize_default_params()
    params.ftype = ftype
    out = folder / "q.gguf"
    assert llama_model_quantize(str(folder / "f32v.gguf").encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    return out


def mxfp4_file(llama_cpp: Path) -> Path:
    """DATA/gpt_oss/mxfp4.gguf: gpt-oss at the test dims with ffn 64 (MXFP4 needs rows of whole blocks of 32),
    converted (float32) and quantized by llama.cpp's MXFP4_MOE (experts MXFP4, the rest as its ftype says)."""
    import tempfile

    global QUANTIZED
    QUANTIZED = {**QUANTIZED, "gpt_oss": {"intermediate_size": 64}}
    with tempfile.TemporaryDirectory() as tmp:
        made = quantized("gpt_oss", llama_cpp, Path(tmp), ftype=38)
        shutil.copy(made, DATA / "gpt_oss" / "mxfp4.gguf")
    return DATA / "gpt_oss" / "mxfp4.gguf"


if __name__ == "__main__" and sys.argv[1] == "--mxfp4":
    print(f"wrote {mxfp4_file(Path(sys.argv[2]))}")
elif __name__ == "__main__" and sys.argv[1] == "--greedy-quantized":
    import tempfile

    for family in sys.argv[3:]:
        with tempfile.TemporaryDirectory() as tmp:
            path = quantized(family, Path(sys.argv[2]), Path(tmp), int(os.environ.get("FTYPE", 15)))
            import gguf  # the converter's own, which it put first on the path
            kinds = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name})
            theirs, ours = greedy(path)
            verdict = "equal" if theirs == ours else "DIFFER"
            print(f"{family} {os.environ.get('FTYPE', 'Q4_K_M')} (experts {'/'.join(kinds)}): llama.cpp {theirs}\n"
                  f"{' ' * len(family)}                      llgraph   {ours}  {verdict}")
            if theirs != ours:
                print(f"{' ' * len(family)}  {near_tie(path, PROMPT, theirs, ours)}")
elif __name__ == "__main__" and sys.argv[1] == "--greedy":
    for family in sys.argv[2:]:
        theirs, ours = greedy(family)
        verdict = "equal" if theirs == ours else "DIFFER"
        print(f"{family}: llama.cpp {theirs}\n{' ' * len(family)}  llgraph   {ours}  {verdict}")
elif __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here / "core"), str(here / "export")]
    from test_families import hf_checkpoint

    only = sys.argv[2:]  # families to write (default: all)
    for family, overrides in MADE.items():
        if only and family not in only:
            continue
        folder = DATA / family
        shutil.rmtree(folder, ignore_errors=True)
        hf_checkpoint(family, folder / "hf", **overrides)
        (folder / "hf" / "generation_config.json").unlink(missing_ok=True)
        vocab = {"model": {"vocab": {f"t{i}": i for i in range(97)}}, "added_tokens": []}  # Gemma 3's row count
        (folder / "hf" / "tokenizer.json").write_text(json.dumps(vocab))
        convert(Path(sys.argv[1]), folder / "hf", folder / "model.gguf")
        (folder / "hf" / "tokenizer.json").unlink()
        print(f"wrote {folder}")
