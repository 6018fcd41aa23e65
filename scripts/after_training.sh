#!/usr/bin/env bash
# Head, calibration, export and profile for the bundled pair once examples/train_tiny_pair.py is done.
set -euxo pipefail
cd "$(dirname "$0")/.."
M=examples/models
# rank 1: with ~16k contexts a wider previous-token embedding overfits (AUROC drops below the fallback's);
# the draft statistics (--stats, on by default) carry most of the signal. 8192 held-out contexts keep the
# ECE's sampling noise near 0.01.
export OMP_NUM_THREADS=1
dspark-trt train-head --target $M/stdlib-target --draft $M/stdlib-draft --data stdlib:train --labels greedy --rank 1 --contexts 16384 --steps 2000 --force
dspark-trt calibrate --target $M/stdlib-target --draft $M/stdlib-draft --data stdlib:heldout --contexts 8192 --report $M/reports/calibration.json
dspark-trt export --target $M/stdlib-target --draft $M/stdlib-draft --out artifacts/tiny --force
dspark-trt profile artifacts/tiny
dspark-trt generate artifacts/tiny --prompt "def fib(n):" --prompt "import os" --compare
