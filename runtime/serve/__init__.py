"""`llgraph serve`: an OpenAI-compatible HTTP server on the engine's scheduler (runtime/engine/scheduler.py).

    llgraph serve MODEL [--backend ort|torch|trt] [--slots 8] [--max-queue 64] [--host 127.0.0.1] [--port 8000]
                        [--grace 10] [--timeout S] [--max-request-bytes 8388608] [--speculative off|ngram|draft=MODEL]
                        [--draft-max 8] [--threads N] [--api-key KEY] [--ray --replicas N [--ray-address auto]]
                        [--kv-cache f16|int8|f32] [--max-seq-len T (default: planned from the free memory)]

Rooms: `app.py` builds the FastAPI app and its routes (/v1/models, /v1/completions, /v1/chat/completions,
/tokenize, /detokenize, /tokenizer_info, /health, /metrics), `completions.py` answers completions and chat (whole
or as server-sent events in OpenAI's chunk format), `request.py` parses and checks each field, `access.py` decides
who may drive it (the API key, JSON bodies only), `plan.py` sizes each slot's context from the free memory,
`run.py` listens, drains on SIGTERM, or runs Ray Serve replicas.
May import the engine and the backends rooms.

What clients send works as they expect: `prompt` as a string, strings, token ids or lists of them; `n` (choice
i*n + j answers prompt i with sample j, seeded seed + j, so each equals a solo request with that seed); `logprobs`
(the model's own, a float64 log-softmax before any sampling parameter: `echo` gives the prompt's, equal to
Runner.score); `response_format` JSON schemas through llguidance, a mask in the engine's sampling; vLLM's
`ignore_eos`, `top_k`, `repetition_penalty`; `stream_options.include_usage`. A field that would change the output
and is not supported (`logit_bias`, `suffix`, penalties, tools, ...) is a 400 naming it, never silently ignored.

Errors are OpenAI's error object: 400 for a bad field (named), malformed or hostile JSON, a prompt too long for the
context (refused without tokenizing when its characters alone cannot fit); 404/405; 413 for a body past
--max-request-bytes, answered before the body is read; 429 (`queue_full`); 503 (`shutting_down`). One request's
failure is its own: the engine ends that request with finish_reason "error" and its neighbours decode on; a seed is
any integer (signed, as OpenAI's). A client that leaves gives up its queue place or slot before the next step.
SIGTERM or Ctrl-C: new requests get 503, running and queued ones get --grace seconds, then the server exits 0 (a
stream cut at the deadline ends with a `shutting_down` error event, never a finish_reason); a second signal stops
at once. Prefix reuse and speculation (`"speculative": "ngram" | "draft" | "off"` per request,
`"speculative.n_max"`) are reported in /metrics.

Throughput: `python -m llgraph.runtime.bench.serve` (clients streaming at once, tokens/s and time to first token).
"""
