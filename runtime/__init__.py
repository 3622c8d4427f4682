"""One cached decode loop (loop.py) behind every runner: ORTRunner (CPU default), TorchRunner (the reference)."""

from llgraph.runtime.loop import Generation, Runner
from llgraph.runtime.runners import ORTRunner, TorchRunner
from llgraph.runtime.sampling import RequestError, Sampling

__all__ = ["Generation", "ORTRunner", "RequestError", "Runner", "Sampling", "TorchRunner"]
