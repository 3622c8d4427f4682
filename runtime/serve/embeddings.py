"""`llgraph serve`'s /v1/embeddings (OpenAI's shape): `input` a string, a list of strings, token ids or a list of
token-id lists; each an embedding request of the scheduler (prefilled on a free slot between decode steps, nothing
sampled: runtime/engine/embed.py), pooled as the server's --pooling says, unit length. `encoding_format` "float" or
"base64" (little-endian float32, what the `openai` client asks for by default). `dimensions` other than the model's
hidden size is a 400: these are not Matryoshka embeddings, so a truncated vector would not mean what it claims."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi.responses import JSONResponse

from llgraph.runtime.serve.completions import failure
from llgraph.runtime.serve.request import ApiError, prompt_ids, prompts_of, submitting, unless_gone


async def embeddings(request, body: dict, runner, scheduler, pooling: str, model: str, capacity: int):
    if "input" not in body:
        raise ApiError(400, "'input' is required: a string, a list of strings, or token ids", param="input")
    try:  # off the event loop: a list of millions of ids takes a while to check
        inputs = await asyncio.to_thread(prompts_of, {"prompt": body["input"]}, runner.tokenizer)
    except ApiError as e:  # completions' wording, this endpoint's field
        raise ApiError(400, str(e).replace("'prompt'", "'input'"), param="input") from None
    if len(inputs) > capacity:
        raise ApiError(400, f"{len(inputs)} inputs; this server takes at most {capacity} at once (its slots and "
                            "queue); send fewer", param="input")
    size = runner.backend.config.hidden_size if runner.backend.config is not None else None
    dimensions = body.get("dimensions")
    if dimensions is not None and dimensions != size:
        raise ApiError(400, f"'dimensions' ({dimensions}) cannot be honoured: this model's embeddings have {size} "
                            "dimensions and are not trained to be truncated; drop the field", param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"'encoding_format' ({encoding!r}) must be \"float\" or \"base64\"",
                       param="encoding_format")
    context = runner.backend.max_seq_len
    ids = await asyncio.to_thread(lambda: [prompt_ids(runner, p, context, "input") for p in inputs])
    handles: list = []
    with submitting(handles):
        for p in ids:
            if len(p) > context:
                raise ApiError(400, f"an input of {len(p)} tokens exceeds this model's context of {context} tokens;"
                                    " shorten it", param="input", code="context_length_exceeded")
            handles.append(scheduler.submit(p, 0, pooling=pooling, loop=asyncio.get_running_loop()))

        async def pooled():
            for h in handles:
                while (event := await h.events.get()).kind != "done":
                    if event.kind == "error":  # 503 when the server shut down first, else 500: as completions
                        raise failure(h, event)
        if await unless_gone(request, pooled(), done=True) is None:  # the client left: its inputs free their slots
            for h in handles:
                h.cancel()
            return JSONResponse({}, status_code=499)
    tokens = sum(len(p) for p in ids)
    return {"object": "list", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(h.embedding, encoding)}
                     for i, h in enumerate(handles)]}


def _encoded(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()
