"""Benchmarks anyone can run, each a module with `python -m` (or `llgraph bench`): `speed.py` (llama-bench for
llgraph: pp/tg, bytes read a token, bandwidth, peers in the same run), `kl.py` (mean KL from the exact computation,
llama.cpp beside), `gguf.py` (the real-size Q4_K_M-shaped test GGUFs), `engines.py` (SmolLM2 against
onnxruntime-genai, transformers and llama.cpp), `prefix.py`, `speculative.py`, `grammar.py`, `serve.py` (the
features' costs and gains), `step_profile.py` (where a decode step's time goes). They take their text as an
argument or carry it (`common.py`). May import every other room but the CLI."""
