"""The engine: one step that every way of decoding drives. `step.py` plans a set of rows (each one sequence in its
cache row: `row.py`'s Params, Row and Output), runs the plan's forward, and updates each row — samples it
(penalties, grammar masks, drafts verified) and returns what it took, an error in one row's work ending that row
alone; `runner.py` (Runner: generate, stream, chat, embed, score) and `scheduler.py` (continuous batching for the
server; `requests.py` what its callers hold) are its drivers and the consumers of its outputs. Beside them:
`sampling.py`, `grammar.py`, `speculative.py` (drafters), `prefix.py` (prefix reuse), `decoding.py` (the text made
from the outputs, stop strings), `score.py` (log-probabilities), `backend.py` (what the engine needs of a backend),
`chat.py` (a conversation).

It imports the core only; the backends room builds on it (each backend's Runner), never the reverse."""
