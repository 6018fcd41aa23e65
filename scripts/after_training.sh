#!/usr/bin/env bash
# Head, calibration, export and profile for the bundled pair once examples/train_tiny_pair.py is done.
set -euxo pipefail
cd "$(dirname "$0")/.."
M=examples/models
dspark-trt train-head --target $M/stdlib-target --draft $M/stdlib-draft --data stdlib:train --labels greedy --steps 2000 --force
dspark-trt calibrate --target $M/stdlib-target --draft $M/stdlib-draft --data stdlib:heldout --report $M/reports/calibration.json
dspark-trt export --target $M/stdlib-target --draft $M/stdlib-draft --out artifacts/tiny --force
dspark-trt profile artifacts/tiny
dspark-trt generate artifacts/tiny --prompt "def fib(n):" --prompt "import os" --compare
