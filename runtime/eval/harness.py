"""llgraph as a model of lm-evaluation-harness (`pip install llgraph[eval]`): any task of the harness on any backend.

    llgraph lm-eval --model llgraph --model_args model=smollm2,backend=ort --tasks hellaswag
    python -m llgraph.runtime.eval.harness --model llgraph --model_args model=EXPORT_FOLDER --tasks my_task \
        --include_path D

    import llgraph.runtime.eval.harness, lm_eval                      # importing registers the model "llgraph"
    lm_eval.simple_evaluate(model="llgraph", model_args="model=smollm2,backend=torch", tasks=[...])

`llgraph lm-eval ARGS` is the harness's own command line (`lm_eval ARGS`) with this module imported first: lm-eval
0.4 finds models only in its own registry (no entry points), so a bare `lm_eval --model llgraph` cannot see it.

model_args: model (an export folder, a checkpoint or 'smollm2'), backend (ort|torch|trt), max_seq_len, the weight
flags of `llgraph generate` (dtype, quantize, block_size, symmetric, lm_head, dequantize), cache_dir, tensorrt,
max_gen_toks.
The harness's batch_size applies (default 8; 'auto' means 8).

Requests are read as lm-eval's Hugging Face model (HFLM) reads them, so the same task gives the same numbers:
tokens without special tokens; an empty context becomes the BOS token (else EOS); context + continuation longer than
the model is cut from the left; rolling log-likelihood in lm-eval's own disjoint windows of the model's length, the
first predicted from BOS; generation stops at `until` or the end-of-text token, its context cut to leave room for
max_gen_toks.
"""

from __future__ import annotations

import sys

try:
    import lm_eval.models  # noqa: F401  (the harness's own models, registered before ours)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
except ImportError as e:
    from llgraph.errors import MissingExtra

    raise MissingExtra("llgraph lm-eval", "lm-eval", "eval", e) from None

from tqdm import tqdm

from llgraph.errors import LlgraphError
from llgraph.runtime.backends import open_runner
from llgraph.runtime.engine.score import score
from llgraph.weight_request import Weights


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("llgraph")
class LlgraphLM(TemplateLM):
    def __init__(self, model: str = "smollm2", backend: str = "ort", max_seq_len: int | None = None,
                 dtype: str = "fp32", quantize: str | None = None, block_size: int = 32, symmetric=False,
                 dequantize=False, accuracy_level=None, lm_head=None, kernels="auto", cache_dir: str | None = None,
                 tensorrt: str = "auto", max_gen_toks: int = 256, kv_cache: str | None = None,
                 batch_size=8, max_batch_size=None, device=None, **unused):
        super().__init__()
        if unused:
            raise LlgraphError(f"unknown model_args {sorted(unused)}; llgraph takes model, backend, max_seq_len, "
                               "dtype, quantize, block_size, symmetric, dequantize, accuracy_level, lm_head, "
                               "kernels, cache_dir, tensorrt, max_gen_toks, kv_cache")
        weights = Weights(str(dtype), quantize or None, int(block_size),
                          _flag(symmetric), _flag(dequantize),
                          None if accuracy_level in (None, "") else int(accuracy_level), lm_head or None,
                          str(kernels))
        self.runner = open_runner(str(model), backend, max_seq_len=int(max_seq_len) if max_seq_len else None,
                                  cache_dir=cache_dir, tensorrt=tensorrt, weights=weights, kv_cache=kv_cache)
        if self.runner.tokenizer is None:
            raise LlgraphError(f"{model} has no tokenizer; lm-eval tasks are texts, so give a model with one")
        self.tok = self.runner.tokenizer
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        eos = sorted(self.runner.eos_token_ids)
        self._eot = self.tok.token_id(self.tok.eos_token)
        if self._eot is None:
            self._eot = eos[0] if eos else None
        if self._eot is None:
            raise LlgraphError(f"{model} names no end-of-text token; lm-eval needs one")
        bos = self.tok.token_id(self.tok.bos_token)
        self._prefix = self._eot if bos is None else bos

    # -- what TemplateLM asks of a model ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.runner.backend.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return "llgraph"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(list(tokens))

    def chat_template(self, chat_template=False) -> str | None:
        return self.tok.chat_template if chat_template is not False else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, add_generation_prompt)

    # -- scoring ------------------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise LlgraphError(f"a continuation of {len(continuation)} tokens is longer than the model "
                                   f"({self.max_length} tokens); raise max_seq_len")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]  # cut from the left, as HFLM
            pairs.append((whole[:len(whole) - len(continuation)], list(continuation)))
        out = []
        for start in tqdm(range(0, len(pairs), self.batch_size), desc="llgraph log-likelihoods", unit="batch",
                          disable=disable_tqdm):
            out += [(s.logprob, s.greedy)
                    for s in score(self.runner.backend, pairs[start:start + self.batch_size], self.batch_size)]
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        return totals

    # -- generation ---------------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request a row of one scheduler (batch_size slots, continuous batching, each its own sampling)."""
        from llgraph.runtime.engine.sampling import Sampling
        from llgraph.runtime.engine.scheduler import Scheduler

        scheduler = Scheduler(self.runner, slots=self.batch_size, max_queue=len(requests)).start()
        try:
            handles = []
            for req in requests:
                context, gen_kwargs = req.args
                kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None),
                                              eos=self.tok_decode([self.eot_token_id]) or None)
                max_gen = min(int(kwargs.pop("max_gen_toks")), self.max_length - 1)
                ids = self.tok_encode(context)[-(self.max_length - max_gen):]
                sampled = kwargs.get("do_sample") and float(kwargs.get("temperature", 0.0)) > 0
                sampling = Sampling(float(kwargs.get("temperature", 0.0)), int(kwargs.get("top_k", 0) or 0),
                                    float(kwargs.get("top_p", 1.0) or 1.0), seed=kwargs.get("seed")) \
                    if sampled else Sampling()
                handles.append(scheduler.submit(ids, max_gen, sampling, stop=[s for s in until if s]))
            out = []
            for req, handle in tqdm(list(zip(requests, handles)), desc="llgraph generate_until",
                                    disable=disable_tqdm):
                text = handle.result().text()
                out.append(text)
                self.cache_hook.add_partial("generate_until", req.args, text)
            return out
        finally:
            scheduler.stop()


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with the model "llgraph" registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
