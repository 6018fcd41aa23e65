"""A stand-in for the TensorRT API dspark-trt calls, modelled line by line on TensorRT's own sources.

TensorRT cannot be installed on CPU machines; the tests pass this fake to the code explicitly, or put it
in sys.modules as ``tensorrt`` / ``tensorrt.plugin`` for the plugin module. Each behaviour cites where
the real one is (NVIDIA/TensorRT at v10.9.0 and 11.1, onnx/onnx-tensorrt):

- enum values per version: include/NvInfer.h ``NetworkDefinitionCreationFlag`` (10.x: STRONGLY_TYPED=1,
  PREFER_JIT_PYTHON_PLUGINS=2, PREFER_AOT_PYTHON_PLUGINS=3; 11.x: 0, 1, 2), NvInferRuntimeBase.h
  ``DataType``, impl/NvInferPythonPlugin.h ``QuickPluginCreationRequest`` (UNKNOWN=0 .. STRICT_AOT=4);
- ``trtp.ShapeExpr`` (plugin/_tensor.py): ``is_fake`` / ``is_constant`` properties, ``constant_value()`` a
  method raising RuntimeError when not constant; ``is_constant`` raises on a fake expression;
- ``trtp.Tensor.__cuda_array_interface__`` raises ValueError for BF16, FP8 and INT4 (plugin/_tensor.py);
- ``trtp.register`` refuses a second definition, ``impl``/``aot_impl`` need a registered plugin, and the
  creator picks an implementation per request exactly as ``_TemplatePluginCreator.create_plugin``
  (plugin/_lib.py) does, raising on an UNKNOWN request when both exist;
- the ONNX parser imports a node as a plugin when it has ``plugin_namespace`` and a creator is registered
  (10.15+ rule; node attribute ``aot`` -> STRICT request, else the network's PREFER flag, else UNKNOWN:
  python/src/infer/pyGraph.cpp, onnx-tensorrt's plugin importer), and otherwise its local function body;
- ``trt.Builder(logger)`` with no usable driver logs "CUDA initialization failure with error: 35" and
  raises pybind11's "factory function returned nullptr" TypeError.
"""

from __future__ import annotations

import sys
import types
from enum import IntEnum

NETWORK_FLAGS = {
    10: {"STRONGLY_TYPED": 1, "PREFER_JIT_PYTHON_PLUGINS": 2, "PREFER_AOT_PYTHON_PLUGINS": 3},
    11: {"STRONGLY_TYPED": 0, "PREFER_JIT_PYTHON_PLUGINS": 1, "PREFER_AOT_PYTHON_PLUGINS": 2},
}


class DataType(IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class QuickPluginCreationRequest(IntEnum):
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


# --------------------------------------------------------------------------------------- tensorrt.plugin
class ShapeExpr:
    def __init__(self, value=None, fake: bool = False):
        self._value, self._fake = value, fake

    @property
    def is_fake(self) -> bool:
        return self._fake

    @property
    def is_constant(self) -> bool:
        if self._fake:
            raise RuntimeError("Not accessible for fake 'ShapeExpr's. Check is_fake to determine accessibility.")
        return isinstance(self._value, int)

    def constant_value(self) -> int:
        if not self.is_constant:
            raise RuntimeError("Not accessible for non-constant shape expressions. Check is_constant to "
                               "determine accessibility.")
        return self._value


class TensorDesc:
    def __init__(self, shape, dtype):
        self.shape_expr = [d if isinstance(d, ShapeExpr) else ShapeExpr(d) for d in shape]
        self.ndim, self.dtype = len(shape), dtype


class Tensor:
    """trtp.Tensor: a descriptor of a device buffer (data_ptr, shape, element strides, dtype)."""

    def __init__(self, data_ptr: int, shape, dtype, strides=None):
        self.data_ptr, self.shape, self.dtype = data_ptr, tuple(shape), dtype
        if strides is None:
            strides, acc = [], 1
            for d in reversed(self.shape):
                strides.insert(0, acc)
                acc *= d
        self.strides = tuple(strides)

    @property
    def __cuda_array_interface__(self):
        if self.dtype in (DataType.BF16, DataType.FP8, DataType.INT4):
            raise ValueError(f"Handling {self.dtype} via '__cuda_array_interface__' is not supported")
        typestr = {DataType.FLOAT: "<f4", DataType.HALF: "<f2", DataType.INT64: "<i8", DataType.INT32: "<i4"}
        size = int(typestr[self.dtype][2:])
        return {"shape": self.shape, "typestr": typestr[self.dtype], "data": (self.data_ptr, False),
                "version": 3, "strides": tuple(s * size for s in self.strides), "stream": None}


class PluginDef:
    def __init__(self, plugin_id, register_func):
        self.plugin_id, self.register_func = plugin_id, register_func
        self.impl_func = self.aot_impl_func = self.autotune_func = None


def _make_plugin_module(trt) -> types.ModuleType:
    trtp = types.ModuleType("tensorrt.plugin")
    registry: dict[str, PluginDef] = {}
    trtp.QDP_REGISTRY = registry

    def register(plugin_id):
        def deco(fn):
            if plugin_id in registry:
                raise ValueError(f"'op' already has a defintion for '{plugin_id.split('::')[1]}'")
            registry[plugin_id] = PluginDef(plugin_id, fn)
            return fn
        return deco

    def _setter(attr):
        def outer(plugin_id):
            def deco(fn):
                if plugin_id not in registry:
                    raise ValueError(f"Plugin {plugin_id} is not registered. Did you register it with "
                                     f"tensorrt.plugin.register API?")
                setattr(registry[plugin_id], attr, fn)
                return fn
            return deco
        return outer

    def create_plugin(plugin_id, qpcr):
        """Which implementation _TemplatePluginCreator.create_plugin (plugin/_lib.py) builds: "jit" | "aot"."""
        desc = registry[plugin_id]
        if qpcr is None:
            return "jit"
        if qpcr == QuickPluginCreationRequest.STRICT_AOT:
            if desc.aot_impl_func is None:
                raise ValueError(f"AOT implementation requested, but not defined for '{plugin_id}'. Was "
                                 f"@trt.plugin.aot_impl defined?")
            return "aot"
        if qpcr == QuickPluginCreationRequest.STRICT_JIT:
            if desc.impl_func is None:
                raise ValueError(f"JIT implementation requested, but not defined for '{plugin_id}'. Was "
                                 f"@trt.plugin.impl defined?")
            return "jit"
        aot, jit = desc.aot_impl_func is not None, desc.impl_func is not None
        if aot and jit:
            if qpcr == QuickPluginCreationRequest.PREFER_AOT:
                return "aot"
            if qpcr == QuickPluginCreationRequest.PREFER_JIT:
                return "jit"
            raise ValueError(f"Plugin '{plugin_id}' has both AOT and JIT implementations. "
                             f"NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS or "
                             f"NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS should be specified.")
        if aot:
            return "aot"
        if jit:
            return "jit"
        raise ValueError(f"Plugin '{plugin_id}' does not have either a AOT or JIT implementation.")

    class KernelLaunchParams:
        pass

    class SymIntExprs(list):
        @classmethod
        def from_tuple(cls, exprs):
            return cls(exprs)

    trtp.register, trtp.create_plugin = register, create_plugin
    trtp.impl, trtp.aot_impl, trtp.autotune = _setter("impl_func"), _setter("aot_impl_func"), _setter("autotune_func")
    trtp.ShapeExpr, trtp.TensorDesc, trtp.Tensor = ShapeExpr, TensorDesc, Tensor
    trtp.KernelLaunchParams, trtp.SymIntExprs, trtp.SymExprs = KernelLaunchParams, SymIntExprs, list
    trtp.SymInt32 = lambda e: ("i32", e)
    trtp.AutoTuneCombination = lambda io_types="", tactics=None: ("combo", io_types)
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(shape, dtype)
    return trtp


# --------------------------------------------------------------------------------------------- tensorrt
def make(version: str = "10.9.0.34", *, gpu: bool = True, build_ok: bool = True, inputs=None):
    """A fake `tensorrt` module (with `.plugin`) of the given version."""
    major = int(version.split(".")[0])
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.DataType = DataType
    trt.float32, trt.float16, trt.bfloat16 = DataType.FLOAT, DataType.HALF, DataType.BF16
    trt.int64, trt.int32, trt.int8 = DataType.INT64, DataType.INT32, DataType.INT8
    trt.NetworkDefinitionCreationFlag = IntEnum("NetworkDefinitionCreationFlag", NETWORK_FLAGS[major])
    trt.QuickPluginCreationRequest = QuickPluginCreationRequest
    trt.LayerType = types.SimpleNamespace(PLUGIN_V3="plugin_v3", MATRIX_MULTIPLY="mm")
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
    trt.BuilderFlag = types.SimpleNamespace()
    trt.OnnxParserFlag = types.SimpleNamespace()
    trt.calls = []
    trt.plugin = trtp = _make_plugin_module(trt)

    class ILogger:
        Severity = IntEnum("Severity", {"INTERNAL_ERROR": 0, "ERROR": 1, "WARNING": 2, "INFO": 3, "VERBOSE": 4})

        def __init__(self):
            pass

    class Layer:
        def __init__(self, kind, what):
            self.type, self.what = kind, what

    class Tensor:
        def __init__(self, name):
            self.name, self.is_shape_tensor = name, False

    class Network:
        def __init__(self, flags):
            self.flags, self.layers, self.input_names = flags, [], list(inputs or [])

        def has_flag(self, name):
            return bool(self.flags & (1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))))

        @property
        def num_layers(self):
            return len(self.layers)

        def get_layer(self, i):
            return self.layers[i]

        @property
        def num_inputs(self):
            return len(self.input_names)

        def get_input(self, i):
            return Tensor(self.input_names[i])

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.errors = network, []

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

        def parse_from_file(self, path):
            with open(path, "rb") as f:
                return self.parse(f.read(), path)

        def parse(self, model: bytes, path=None):
            import onnx

            m = onnx.load_from_string(model)
            trt.calls.append(("parse", path))
            if not self.network.input_names:
                self.network.input_names = [i.name for i in m.graph.input]
            local = {(f.domain, f.name) for f in m.functions}
            for node in m.graph.node:
                attrs = {a.name: a for a in node.attribute}
                ns = attrs["plugin_namespace"].s.decode() if "plugin_namespace" in attrs else None
                pid = f"{ns}::{node.op_type}"
                if ns is not None and pid in trtp.QDP_REGISTRY:
                    if "aot" in attrs:
                        req = QuickPluginCreationRequest.STRICT_AOT if attrs["aot"].i else \
                            QuickPluginCreationRequest.STRICT_JIT
                    elif self.network.has_flag("PREFER_JIT_PYTHON_PLUGINS"):
                        req = QuickPluginCreationRequest.PREFER_JIT
                    elif self.network.has_flag("PREFER_AOT_PYTHON_PLUGINS"):
                        req = QuickPluginCreationRequest.PREFER_AOT
                    else:
                        req = QuickPluginCreationRequest.UNKNOWN
                    try:
                        kind = trtp.create_plugin(pid, req)
                    except ValueError as e:
                        self.errors.append(f"In node {node.name} (importFallbackPluginImporter): {e}")
                        return False
                    self.network.layers.append(Layer("plugin_v3", (pid, kind)))
                elif (node.domain, node.op_type) in local:
                    self.network.layers.append(Layer("function_body", node.op_type))
                else:
                    self.network.layers.append(Layer("mm", node.op_type))
            return True

    class Profile:
        def set_shape(self, name, mn, op, mx):
            trt.calls.append(("set_shape", name, mn, op, mx))

    class Config:
        def set_memory_pool_limit(self, pool, limit):
            trt.calls.append(("pool", pool, limit))

        def add_optimization_profile(self, profile):
            trt.calls.append(("add_profile",))

    class Builder:
        def __init__(self, logger):
            if not gpu:
                logger.log(ILogger.Severity.ERROR, "[checkMacros.cpp::catchCudaError::212] Error Code 1: Cuda "
                                                   "Runtime (CUDA initialization failure with error: 35)")
                raise TypeError("pybind11::init(): factory function returned nullptr")

        def create_network(self, flags):
            trt.calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            return b"serialized" if build_ok else None

    trt.ILogger, trt.Builder, trt.OnnxParser = ILogger, Builder, OnnxParser
    return trt


def install(monkeypatch, trt) -> None:
    """Put the fake in sys.modules as `tensorrt` and `tensorrt.plugin` (undone by monkeypatch)."""
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trt.plugin)
