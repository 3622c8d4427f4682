"""TensorRT's own `tensorrt.plugin` (QDP) Python sources, loaded over a stand-in `tensorrt` module.

The QDP module is pure Python (it ships in the tensorrt-cu13-bindings wheel, next to the bindings that need
libnvinfer); loading it over a stand-in lets the tests run TensorRT's real signature validators, output
descriptions and autotune parsing on llgraph's registrations on a machine without TensorRT. Run it in a
subprocess: it puts a fake `tensorrt` into sys.modules.
"""
import importlib.util
import os
import sys
import types


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})


class _Stub(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})()

    def __call__(self, *args, **kwargs):
        return _Stub()


def load():
    trt = types.ModuleType("tensorrt")
    trt.__path__ = []
    trt.Dims = type("Dims", (), {"MAX_DIMS": 8})
    trt.__getattr__ = lambda name: _Meta(name, (_Stub,), {})
    sys.modules["tensorrt"] = trt
    where = importlib.util.find_spec("tensorrt_bindings").submodule_search_locations[0]
    folder = os.path.join(where, "plugin")
    s = importlib.util.spec_from_file_location("tensorrt.plugin", os.path.join(folder, "__init__.py"),
                                               submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(s)
    sys.modules["tensorrt.plugin"] = module
    s.loader.exec_module(module)
    trt.plugin = module
    return module
