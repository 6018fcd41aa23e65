"""The smallest embedding of dspark-trt: load an exported artifact and stream one completion.

    python examples/embedded_app.py [ARTIFACT_DIR] [--prompt "def fib(n):"] [--max-tokens 48]

ARTIFACT_DIR defaults to artifacts/tiny (make one with `dspark-trt export`).
"""

from __future__ import annotations

import argparse
import sys

from dspark_trt.errors import DsparkError
from dspark_trt.runtime import GenerationConfig, Runtime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact_dir", nargs="?", default="artifacts/tiny")
    ap.add_argument("--prompt", default="def fib(n):")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--backend", default="ort", choices=["ort", "torch", "trt"])
    args = ap.parse_args(argv)
    try:
        with Runtime.load(args.artifact_dir, backend=args.backend) as rt:
            print(args.prompt, end="", flush=True)
            for piece in rt.stream(args.prompt, GenerationConfig(max_new_tokens=args.max_tokens)):
                print(piece, end="", flush=True)
            print()
    except DsparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
