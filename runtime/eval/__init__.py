"""Evaluation that proves an engine still answers like the reference: `evaluate.py` (`llgraph eval`: tasks of
lm-evaluation-harness's formats run on a runner), `harness.py` (llgraph as an lm-eval model, `llgraph lm-eval`),
`diff.py` (`llgraph diff`: every IR value of two backends compared, step by step). May import the engine and the
backends rooms."""
