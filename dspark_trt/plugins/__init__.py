"""The dspark custom ops (acceptance scoring inside the engine): one spec, many implementations.

* :mod:`.spec`            the contract: names, I/O, attributes, shape rules, ``make_node``  (no deps)
* :mod:`.reference`       numpy ground truth                                                (numpy)
* :mod:`.onnx_functions`  model-local ONNX FunctionProtos, ``attach_functions``            (onnx)
* :mod:`.launch`          grids and block sizes                                             (no deps)
* :mod:`.kernels`         Triton kernels, torch launchers, AOT PTX compilation              (torch, triton)
* :mod:`.markov_kernels`  the Markov ops' Triton kernels (the DSpark sequential stage)    (torch, triton)
* :mod:`.ptx`             the PTX ISA the AOT kernels are emitted in                        (no deps)
* :mod:`.tensorrt_plugins` TensorRT plugin registration, ``register(impls)``                (tensorrt)

This package imports only the spec: importing it must never pull in torch, triton or tensorrt.
"""

from dspark_trt.plugins.spec import DOMAIN, OPS, PLUGIN_NAMESPACE, VERSION, OpSpec, make_node

__all__ = ["DOMAIN", "OPS", "PLUGIN_NAMESPACE", "VERSION", "OpSpec", "make_node"]
