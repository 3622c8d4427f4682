"""The engine: one step that every way of decoding drives. `step.py` runs a set of rows (each one sequence in its
cache row) through the backend's forward, samples each (penalties, grammar masks, drafts verified), and updates each
row's state, an error in one row's work ending that row alone; `runner.py` (Runner: generate, stream, chat, score)
and `scheduler.py` (continuous batching for the server; `requests.py` what its callers hold) are its drivers.
Beside them: `sampling.py`, `grammar.py`, `speculative.py` (drafters), `prefix.py` (prefix reuse), `decoding.py`
(stop rules, streamed text), `score.py` (log-probabilities), `backend.py` (what the engine needs of a backend),
`chat.py` (a conversation).

It imports the core only; the backends room builds on it (each backend's Runner), never the reverse."""
