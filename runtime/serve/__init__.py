"""`llgraph serve`: an OpenAI-compatible HTTP server on the engine's scheduler (runtime/engine/scheduler.py).

    llgraph serve MODEL [--backend ort|torch|trt] [--slots 8] [--max-queue 64] [--host 127.0.0.1] [--port 8000]
                        [--grace 10] [--timeout S] [--max-request-bytes 8388608] [--speculative off|ngram|draft=MODEL]
                        [--draft-max 8] [--threads N] [--api-key KEY] [--ray --replicas N [--ray-address auto]]
                        [--kv-cache f16|int8|f32] [--max-seq-len T (default: planned from the free memory)]

Rooms: `app.py` builds the FastAPI app and its routes (/v1/models[/{id}], /v1/completions, /v1/chat/completions,
/v1/responses[/{id}], /v1/messages[/count_tokens], /v1/embeddings — each also without /v1 —, /tokenize, /detokenize,
/tokenizer_info, /health, /metrics, the chat page at / from `chat.html`), `ask.py` parses a completion or chat
request, `completions.py` answers it (whole or as server-sent events in OpenAI's chunk format), `responses.py`
OpenAI's Responses API and `messages.py` Anthropic's Messages API over the same answer, `embeddings.py`
/v1/embeddings, `request.py` parses and checks each field, `body.py` reads and decodes bodies off the event loop,
`access.py` decides who may drive it and from where (the API key, the Host, the Origin, CORS), `plan.py` sizes each
slot's context from the free memory, `run.py` listens, drains on SIGTERM, or runs Ray Serve replicas.
May import the engine and the backends rooms.

What clients send works as they expect: `prompt` as a string, strings, token ids or lists of them; `n` (choice
i*n + j answers prompt i with sample j, seeded seed + j, so each equals a solo request with that seed); `logprobs`
(the model's own, a float64 log-softmax before any sampling parameter: `echo` gives the prompt's, equal to
Runner.score); `response_format` JSON schemas through llguidance, a mask in the engine's sampling; vLLM's
`ignore_eos`, `top_k`, `min_p`, `repetition_penalty`; OpenAI's `frequency_penalty`, `presence_penalty` and
`logit_bias` (a bias of -100 bans a token) on every sampling path; llama.cpp's `grammar` (GBNF) and top-level
`json_schema`, and `response_format` json_object with a `schema`; vLLM's `add_generation_prompt` and
`continue_final_message`; `stream_options.include_usage`. OpenAI's bookkeeping fields (`metadata`, `store`, `user`,
`service_tier`, ...) are taken and change nothing. A field that would change the output and is not supported
(`suffix`, `min_tokens`, ...) is a 400 naming it, never silently ignored.

Sampling a request leaves unset takes the model's recommended value (its generation_config.json, a GGUF's
`general.sampling.*`), else llama-server's default (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05): OpenAI's
temperature 1 over the whole vocabulary makes a small model answer nonsense. `llgraph serve` prints the values it
uses; `GET /props` returns them (llama-server's route), and the chat page shows and sets the temperature.

Errors are OpenAI's error object: 400 for a bad field (named), malformed or hostile JSON, a prompt too long for the
context (refused without tokenizing when its characters alone cannot fit); 404/405; 413 for a body past
--max-request-bytes, answered before the body is read; 429 (`queue_full`); 503 (`shutting_down`). One request's
failure is its own: the engine ends that request with finish_reason "error" and its neighbours decode on; a seed is
any integer (signed, as OpenAI's). A client that leaves gives up its queue place or slot before the next step.
SIGTERM or Ctrl-C: new requests get 503, running and queued ones get --grace seconds, then the server exits 0 (a
stream cut at the deadline ends with a `shutting_down` error event, never a finish_reason); a second signal stops
at once. Prefix reuse and speculation (`"speculative": "ngram" | "draft" | "off"` per request,
`"speculative.n_max"`) are reported in /metrics.

Tool calling (runtime/engine/tools.py): `tools`, `tool_choice` (`none`, `auto`, `required`, a named function),
`parallel_tool_calls`; the tools rendered by the model's own chat template (as transformers passes them), or, for a
template that knows none (SmolLM2's), in the Hermes format in the system message. Calls are parsed from the
Hermes/Qwen `<tool_call>` form and Llama 3.1's JSON form into `tool_calls` (streamed as OpenAI's deltas; content is
held back only where a call may begin). `required` and named calls are constrained by the grammar engine, so their
arguments validate against the function's schema (Pydantic's `$defs`/`$ref` included); a named choice is exactly one
call, `parallel_tool_calls` unset or not; calls complete before `max_tokens` or a stop string come back as
`tool_calls` (finish_reason `length`); a call repeated word for word is returned once. Under `auto` any valid JSON
schema is taken (nothing is constrained). At most 128 tools.

Embeddings (/v1/embeddings, embeddings.py): the last hidden states pooled by the last token (default) or the mean
(`--pooling`), unit length; `encoding_format` float or base64; `dimensions` other than the model's is a 400.

One prefill path: every prompt — to answer, to embed (each input a row of the scheduler) or to score (`echo` with
`logprobs`) — is written `--prefill-chunk` tokens at a time between two decode steps of the running requests; a
client that leaves, on any route, frees its rows within a step (checked every 0.5 s).

One request never changes another. llgraph's CPU kernels are batch-invariant: a row's logits and the keys and values
it writes are the same bits whatever shares its forward — how many rows, how many tokens, a prompt written whole or
in chunks, a prefix reused from the cache or computed fresh, one thread or several
(tests/plugins/test_cpu_batch_invariance.py: every block type, level, KV format and instruction set). So a seeded
request gives the same text alone, beside others, or after anyone who shared its prefix, in every `--kv-cache`
format; `n` choices equal solo requests with seeds seed, seed+1, ...; prompt log-probabilities do not depend on what
was cached (tests/engine/test_batch_invariance.py). Not guaranteed: the same bits on another instruction set
(AVX-512, AVX2 and scalar sum in different orders), on ONNX Runtime's own ops (`--kernels standard`, float
exports), on the torch executor, or on a TensorRT engine.

The event loop only moves bytes (body.py): bodies are decoded off it (from 1 MB in a spawned worker process, since
JSON decoding holds the GIL), chat templates, tools and grammars are built off it, and absurd inputs are refused
before any of that (more than 128 tools, more messages or tool calls than the context has tokens).
Soak: `python -m llgraph.runtime.bench.soak --requests 650 --every 130` (mixed requests from 8 clients, embeddings,
scored prompts and tool calls included: RSS levelled at 451-491 MB, no 5xx, a stream's largest gap 0.38 s).

Throughput: `python -m llgraph.runtime.bench.serve` (clients streaming at once, tokens/s and time to first token).
"""
