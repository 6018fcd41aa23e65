"""Scale out on Ray Serve: N replicas, each with its own Runtime, behind Ray's HTTP proxy.

Every replica loads the artifact and runs the same OpenAI-compatible app as `dspark-trt serve`
(dspark_trt.serve.server.create_app); Ray's proxy spreads requests over the replicas, and each replica's
runtime batches what it gets.

    pip install "ray[serve]"
    python examples/ray_serve_app.py artifacts/tiny --replicas 2 --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "tiny", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0}'

or with Ray's CLI (the builder takes key=value arguments):

    serve run examples.ray_serve_app:build_app artifact_dir=artifacts/tiny replicas=2

Each replica asks Ray for --replica-cpus CPUs (and --replica-gpus GPUs: set 1 with --backend trt).
Responses carry an `x-dspark-replica` header naming the replica process that answered.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from ray import serve


class _ReplicaHeader:
    """ASGI middleware: add `x-dspark-replica: <pid>` to every response."""

    def __init__(self, app):
        self.app = app
        self.value = str(os.getpid()).encode()

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [(b"x-dspark-replica", self.value)]
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


@serve.deployment
@serve.ingress()
class DsparkReplica:
    """One Runtime per replica; the ASGI app is built after the runtime exists (Ray's late-bound ingress)."""

    def __init__(self, artifact_dir: str, backend: str = "ort", max_batch: int | None = None,
                 max_queue: int | None = 256, model_name: str | None = None):
        from dspark_trt.runtime import Runtime

        self.model_name = model_name or Path(artifact_dir).resolve().name
        self.rt = Runtime.load(artifact_dir, backend=backend, max_batch=max_batch, max_queue=max_queue)

    def __serve_build_asgi_app__(self):
        from dspark_trt.serve.server import create_app

        app = create_app(self.rt, model_name=self.model_name)
        app.add_middleware(_ReplicaHeader)
        return app

    def __del__(self):
        rt = getattr(self, "rt", None)
        if rt is not None:
            rt.close()


def build_app(args: dict):
    """Ray Serve application builder (`serve run examples.ray_serve_app:build_app artifact_dir=...`)."""
    artifact_dir = str(Path(args["artifact_dir"]).resolve())
    max_batch = args.get("max_batch")
    return DsparkReplica.options(
        num_replicas=int(args.get("replicas", 2)),
        max_ongoing_requests=int(args.get("max_ongoing_requests", 256)),
        ray_actor_options={"num_cpus": float(args.get("replica_cpus", 1)),
                           "num_gpus": float(args.get("replica_gpus", 0))},
    ).bind(artifact_dir, args.get("backend", "ort"), int(max_batch) if max_batch else None,
           int(args.get("max_queue", 256)), args.get("model_name"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve a dspark-trt artifact on Ray Serve with N replicas.")
    ap.add_argument("artifact_dir", nargs="?", default="artifacts/tiny")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--backend", default="ort", choices=["ort", "torch", "trt"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs for a local Ray (default: all)")
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--replica-gpus", type=float, default=0.0)
    args = ap.parse_args(argv)
    if not (Path(args.artifact_dir) / "manifest.json").is_file():
        print(f"error: no artifact at {args.artifact_dir}: create one with `dspark-trt export`", file=sys.stderr)
        return 1

    import ray

    # A private local Ray (never an existing cluster), on the loopback address.
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app({"artifact_dir": args.artifact_dir, "replicas": args.replicas, "backend": args.backend,
                     "max_batch": args.max_batch, "max_queue": args.max_queue,
                     "replica_cpus": args.replica_cpus, "replica_gpus": args.replica_gpus})
    serve.run(app, name="dspark", route_prefix="/")
    print(f"serving {args.artifact_dir} on http://{args.host}:{args.port}/v1 with {args.replicas} replicas",
          flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
