"""Triton Inference Server Python-backend model embedding a dspark-trt Runtime (decoupled streaming).

Triton calls `execute` with a list of requests; in decoupled mode it returns None at once and each request
is answered through its response sender from a thread of its own: one response per group of tokens the
runtime commits (`text` holds the new text), then a last response that carries `finish_reason` and the
TRITONSERVER_RESPONSE_COMPLETE_FINAL flag. The runtime batches all in-flight requests itself (continuous
batching), so Triton's dynamic batcher stays off. A request Triton cancels (client gone) is cancelled in
the runtime, which frees its KV slot at the next step.

Inputs: prompt (string), optional max_tokens (int32, default 64), temperature (fp32, default 0), seed
(int64), spec (string: off | fixed:K | adaptive), stop (strings). Outputs: text, finish_reason (string;
empty until the last response), completion_tokens (int32, tokens so far).

Needs `dspark-trt` installed in the Python that Triton's Python backend runs.
"""

import json
import os
import queue
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from dspark_trt.errors import DsparkError
from dspark_trt.runtime import GenerationConfig, QueueFullError, Runtime
from dspark_trt.serve.text import TextStream


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size == 0:
        return default
    value = value[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item() if hasattr(value, "item") else value


def _strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1)]


def _response(text: str, finish_reason: str, completion_tokens: int):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("completion_tokens", np.array([completion_tokens], dtype=np.int32)),
    ])


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the dspark model streams: set model_transaction_policy "
                                                "{ decoupled: true } in config.pbtxt")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        artifact = os.environ.get("DSPARK_ARTIFACT_DIR") or params.get("artifact_dir") or "artifacts/tiny"
        path = Path(artifact)
        if not path.is_absolute():
            path = Path(args.get("model_repository", ".")) / path
        max_batch = int(params["max_batch"]) if params.get("max_batch") else None
        max_queue = int(params["max_queue"]) if params.get("max_queue") else None
        try:
            self.rt = Runtime.load(path, backend=params.get("backend") or "ort", max_batch=max_batch,
                                   max_queue=max_queue)
        except DsparkError as e:
            raise pb_utils.TritonModelException(f"dspark: {e}") from None
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt = _scalar(request, "prompt")
                if not prompt:
                    raise DsparkError("input `prompt` is empty")
                config = GenerationConfig(max_new_tokens=int(_scalar(request, "max_tokens", 64)),
                                          temperature=float(_scalar(request, "temperature", 0.0)),
                                          seed=int(_scalar(request, "seed", 0)),
                                          spec=str(_scalar(request, "spec", "adaptive") or "adaptive"),
                                          stop=[s for s in _strings(request, "stop") if s])
                req = self.rt.submit(prompt, config, stream=True)
            except (DsparkError, ValueError, TypeError) as e:
                busy = isinstance(e, QueueFullError)
                message = f"dspark: server is busy, retry later ({e})" if busy else f"dspark: {e}"
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            t = threading.Thread(target=self._stream, args=(req, sender), daemon=True)
            with self.lock:
                self.threads.add(t)
            t.start()
        return None  # decoupled: responses go through the senders

    def _stream(self, req, sender):
        text = TextStream(self.rt.tokenizer.decode, req.config.stop)
        count = 0
        try:
            while True:
                try:
                    ids = req.pieces.get(timeout=0.5)
                except queue.Empty:  # nothing committed yet (still queued): look for a cancellation anyway
                    ids = ()
                if sender.is_cancelled():
                    # Free the KV slot; Triton still needs the final flag after a cancellation.
                    self.rt.cancel(req)
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                if ids is None:
                    break
                if not ids:
                    continue
                count += len(ids)
                piece = text.push(ids)
                if piece:
                    sender.send(_response(piece, "", count))
            if req.finish_reason == "error":
                sender.send(pb_utils.InferenceResponse(output_tensors=[],
                                                       error=pb_utils.TritonError(f"dspark: {req.error}")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(_response(text.finish(req.finish_reason), req.finish_reason or "", count),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            if not req.finished:
                self.rt.cancel(req)
            with self.lock:
                self.threads.discard(threading.current_thread())

    def finalize(self):
        self.rt.close()  # finishes every in-flight request (with an error), so each stream sends its final
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=10)
