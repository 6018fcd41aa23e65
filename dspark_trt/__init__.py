"""dspark-trt: adaptive speculative decoding with confidence heads, ONNX + TensorRT."""

__version__ = "0.1.0"

from dspark_trt.errors import DsparkError  # noqa: E402

__all__ = ["DsparkError", "__version__"]
