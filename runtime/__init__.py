"""One engine (runtime/engine/: the step, the runner, the scheduler) behind every runner: ORTRunner (CPU default),
TRTRunner (a TensorRT engine on a GPU), TorchRunner (the reference). Each backend is one module in runtime/backends/
plus one line in its registry (runtime/backends/__init__.py).

The names below load on first use (PEP 562), so importing a light module of this package (the registry, the
sampling rules) does not import every backend and its tensor library."""

import importlib

_EXPORTS = {"Generation": "llgraph.runtime.engine.runner", "Runner": "llgraph.runtime.engine.runner",
            "ORTRunner": "llgraph.runtime.backends.ort", "TorchRunner": "llgraph.runtime.backends.pytorch",
            "TRTRunner": "llgraph.runtime.backends.trt", "open_runner": "llgraph.runtime.backends",
            "RequestError": "llgraph.errors", "Sampling": "llgraph.runtime.engine.sampling",
            "build_engine": "llgraph.export.trt_build"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llgraph.runtime' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return __all__
