"""`llgraph serve`: an OpenAI-compatible HTTP server on the engine's scheduler. `app.py` builds the FastAPI app and
its routes, `completions.py` answers /v1/completions and /v1/chat/completions (whole or streamed), `request.py`
parses and checks each request field (a 400 naming it), `run.py` listens, drains on SIGTERM, or serves Ray Serve
replicas. May import the engine and the backends rooms."""
