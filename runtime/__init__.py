"""One cached decode loop (loop.py) behind every runner: ORTRunner (CPU default), TRTRunner (a TensorRT engine on
a GPU), TorchRunner (the reference)."""

from llgraph.export.engine import build_engine
from llgraph.runtime.loop import Generation, Runner
from llgraph.runtime.runners import ORTRunner, TorchRunner, TRTRunner, open_runner
from llgraph.runtime.sampling import RequestError, Sampling

__all__ = ["Generation", "ORTRunner", "RequestError", "Runner", "Sampling", "TRTRunner", "TorchRunner",
           "build_engine", "open_runner"]
