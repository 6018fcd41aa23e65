"""The runtime (numpy core; no torch needed): load an artifact, generate, stream."""

from dspark_trt.runtime.config import GenerationConfig
from dspark_trt.runtime.runtime import GenerationResult, QueueFullError, Runtime

__all__ = ["GenerationConfig", "GenerationResult", "QueueFullError", "Runtime"]
