"""What users read, against llama.cpp on the same file: the bundled SmolLM2-135M-Instruct GGUF (Q4_1) and files made
from it by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, requantizing): Q4_K_M, Q3_K_M, Q2_K,
IQ4_XS (SmolLM2's 576-wide rows take llama.cpp's fallbacks: Q4_0/Q5_0 for the K-quants, IQ4_NL for IQ4_XS). For each
chat question, greedy: whether the prompt ids are llama.cpp's, whether llgraph's streamed text is its whole text,
whether llama.cpp's detokenize of llgraph's ids is llgraph's text, both answers, and where they first differ the
probability llama.cpp gives each side's token (a near-tie, or not).

    python tests/llama_cpp_answers.py [OUT_DIR [TYPE...]]   # needs llama-cpp-python (built from its sdist);
                                                              # TYPE: Q4_K_M (default), Q3_K_M, Q2_K, IQ4_XS
"""

import ctypes
import sys
from pathlib import Path

import numpy as np

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a list.",
             "List three colours, one per line."]


FTYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "IQ4_XS": 30}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def quantized(src: Path, out: Path, ftype: str) -> Path:
    from llama_cpp import llama_model_quantize, llama_model_quantize_default_params

    if not out.exists():
        params = llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = FTYPES[ftype], True
        assert llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def compare(path: Path, cache: Path, steps: int = 48) -> None:
    from llama_cpp import Llama

    from llgraph.runtime import open_runner

    llm = Llama(str(path), n_ctx=512, verbose=False, logits_all=True)
    runner = open_runner(str(path), "ort", max_seq_len=512, cache_dir=str(cache))
    for question in QUESTIONS:
        prompt = runner.render_chat([{"role": "user", "content": question}])
        ids = runner.encode(prompt)
        ours = runner.generate(ids, steps, temperature=0.0).token_ids
        text = runner.tokenizer.decode(ours)
        streamed = "".join(runner.stream(ids, steps, temperature=0.0))
        llm.reset()
        llm.eval(ids)
        theirs, probs = [], []
        for _ in range(steps):
            logits = np.array(llm.scores[llm.n_tokens - 1], np.float64)
            p = np.exp(logits - logits.max())
            probs.append(p / p.sum())
            token = int(np.argmax(logits))
            if token == llm.token_eos():
                break
            theirs.append(token)
            llm.eval([token])
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
        where = "none" if at is None else (f"token {at}: llama.cpp p={probs[at][theirs[at]]:.3f}, llgraph's choice "
                                           f"p={probs[at][ours[at]]:.3f}")
        print(f"{path.name} | {question!r}\n  prompt ids equal llama.cpp's: "
              f"{ids == llm.tokenize(prompt.encode(), add_bos=False, special=True)}; streamed == whole: "
              f"{streamed == text}; llama.cpp detokenize(llgraph's ids) == llgraph's text: "
              f"{llm.detokenize(ours).decode('utf-8', 'replace') == text}\n  llama.cpp: "
              f"{llm.detokenize(theirs).decode('utf-8', 'replace')!r}\n  llgraph:   {text!r}\n  first difference: "
              f"{where}")


if __name__ == "__main__":
    from llgraph.bundled import bundled_model

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "llama-cpp-answers")
    out.mkdir(exist_ok=True)
    source = Path(bundled_model("smollm2"))
    types = sys.argv[2:] or ["Q4_K_M"]
    for gguf in (source, *(quantized(source, out / f"smollm2-{t.lower()}.gguf", t) for t in types)):
        compare(gguf, out / "cache")
