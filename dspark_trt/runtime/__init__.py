"""The runtime (numpy core; no torch needed): load an artifact, generate, stream."""

from dspark_trt.runtime.config import GenerationConfig
from dspark_trt.runtime.runtime import GenerationResult, QueueFullError, Runtime
from dspark_trt.runtime.tuning import RuntimeTuning

__all__ = ["GenerationConfig", "GenerationResult", "QueueFullError", "Runtime", "RuntimeTuning"]
