#!/usr/bin/env bash
# The one prepared check for a GPU machine (one NVIDIA GPU, PyTorch and Triton; TensorRT optional), from a
# fresh checkout, in under 8 minutes (stages share a time budget, GPU_CHECK_BUDGET_S, default 450 s). Everything goes to one log file ($OUT/gpu_check.log).
#
#   bash scripts/gpu_check.sh                  # on the GPU machine
#   bash scripts/gpu_check.sh --cpu-dry-run    # every stage that can run on CPU, small (the test suite runs it)
#   options: --artifact DIR (reuse an exported artifact instead of exporting the bundled tiny pair)
#            --out DIR (default gpu_check_out)
#
# Stages (python -m dspark_trt.bench.gpu_check; each in its own process):
#   (a) kernels      Triton acceptance kernels natively on CUDA against the numpy reference
#   (b) lossless     torch backend on CUDA in fp16: greedy adaptive and fixed:K == spec off
#   (c) timing       fixed:K vs adaptive at 1 and 32 requests
#   (d) TensorRT     when `import tensorrt` works: build both engines in AOT and in JIT mode (one copy of the
#                    artifact each), then load them in a fresh process and compare with ONNX Runtime
# Installing: the project's own dependencies are installed only when missing. Never with
# constraints-cpu.txt here (it pins the CPU build of torch): the torch already on the machine is used,
# or `pip install torch` when there is none. TensorRT is not installed by this script (stage d is skipped
# without it) unless GPU_CHECK_INSTALL_TRT=1.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"

MODE=gpu
OUT=gpu_check_out
ARTIFACT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu ;;
    --artifact) ARTIFACT="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

PY="${PYTHON:-python3}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
FAILED=()
SKIPPED=()
T_START=$SECONDS

log() { echo "[gpu_check $(date -u +%H:%M:%S) +$((SECONDS - T_START))s] $*"; }

# stage NAME TIMEOUT_S COMMAND...: run one stage, record pass/fail/skip (exit 2 = skipped)
# Every stage also fits in what is left of BUDGET_S (default 450 s: the whole run stays under 8 minutes).
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
stage() {
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET_S - (SECONDS - T_START)))
  if (( left < 15 )); then log "stage $name: not run, the ${BUDGET_S}s budget is spent"; FAILED+=("$name"); return; fi
  (( limit > left )) && limit=$left
  log "stage $name (limit ${limit}s): $*"
  local t0=$SECONDS rc
  timeout "$limit" "$@"
  rc=$?
  case $rc in
    0) log "stage $name: ok ($((SECONDS - t0))s)" ;;
    2) log "stage $name: skipped"; SKIPPED+=("$name") ;;
    124) log "stage $name: TIMED OUT after ${limit}s"; FAILED+=("$name") ;;
    *) log "stage $name: FAILED (exit $rc, $((SECONDS - t0))s)"; FAILED+=("$name") ;;
  esac
}

log "mode $MODE, repo $REPO, python $($PY -c 'import sys; print(sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader

# ------------------------------------------------------------------------------------------ install
missing() {  # the import names among "$@" that do not import
  for m in "$@"; do $PY -c "import $m" 2>/dev/null || echo "$m"; done
}
# An offline machine installs from a folder of wheels: GPU_CHECK_WHEELS=DIR (made elsewhere with
# `pip download -d DIR onnxruntime onnx onnxscript tokenizers safetensors click tqdm` for its Python).
PIP=("$PY" -m pip install)
[[ -n "${GPU_CHECK_WHEELS:-}" ]] && PIP+=(--no-index --find-links "$GPU_CHECK_WHEELS")
if [[ $MODE == gpu ]]; then
  if [[ -n "$(missing torch)" ]]; then
    log "no torch here: pip install torch (a CUDA build from the default index)"
    "${PIP[@]}" torch || log "cannot install torch: every stage will fail"
  fi
  declare -A SPEC=([numpy]="numpy>=1.24" [onnxruntime]="onnxruntime>=1.17" [tokenizers]="tokenizers>=0.15"
                   [safetensors]="safetensors>=0.4" [click]="click>=8.1" [tqdm]="tqdm>=4.60" [onnx]="onnx>=1.16"
                   [onnxscript]="onnxscript>=0.2" [triton]="triton>=3.4,<4")
  NEED=()
  for m in $(missing "${!SPEC[@]}"); do NEED+=("${SPEC[$m]}"); done
  if [[ ${#NEED[@]} -gt 0 ]]; then
    log "installing ${NEED[*]}"
    # one at a time: what installs is used, and the stages that need the rest fail with their own message
    for req in "${NEED[@]}"; do "${PIP[@]}" "$req" || log "cannot install $req (offline? see GPU_CHECK_WHEELS)"; done
  fi
  if [[ -n "$(missing tensorrt)" && "${GPU_CHECK_INSTALL_TRT:-0}" == 1 ]]; then
    log "installing TensorRT (GPU_CHECK_INSTALL_TRT=1)"
    $PY -m pip install "tensorrt>=10.9" "polygraphy>=0.49" || log "TensorRT did not install: stage d skipped"
  fi
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available(), '| triton', triton.__version__)" || log "torch or triton missing"
  $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { log "torch sees no CUDA GPU: run with --cpu-dry-run on a machine without one"; exit 1; }
  DEVICE=cuda
else
  DEVICE=cpu
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""  # kernels in Triton's interpreter, on CPU tensors
fi
HAVE_TRT=0
$PY -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>/dev/null && HAVE_TRT=1

# ------------------------------------------------------------------------------------------ artifact
if [[ -z "$ARTIFACT" ]]; then
  ARTIFACT="$OUT/tiny"
  log "exporting the bundled tiny pair to $ARTIFACT"
  timeout 180 $PY -m dspark_trt.cli export --target examples/models/stdlib-target --draft examples/models/stdlib-draft \
      --out "$ARTIFACT" --max-batch 32 --max-context 512 --force \
    || { log "export FAILED: the stages that need the artifact will fail"; FAILED+=("export"); }
fi

# ------------------------------------------------------------------------------------------ stages
CHECK=("$PY" -m dspark_trt.bench.gpu_check)
if [[ $MODE == gpu ]]; then
  stage kernels 120 "${CHECK[@]}" kernels --device cuda
  stage lossless 90 "${CHECK[@]}" lossless --artifact "$ARTIFACT" --device cuda --dtype fp16 --max-new-tokens 48
  stage timing 150 "${CHECK[@]}" timing --artifact "$ARTIFACT" --device cuda --dtype fp16 --max-new-tokens 48 \
      --concurrency 1,32
else
  stage kernels 120 "${CHECK[@]}" kernels --device cpu
  stage lossless 120 "${CHECK[@]}" lossless --artifact "$ARTIFACT" --device cpu --dtype bf16 --max-new-tokens 8
  stage timing 120 "${CHECK[@]}" timing --artifact "$ARTIFACT" --backend ort --device cpu --max-new-tokens 4 \
      --concurrency 1,4 --profile none
fi

if [[ $HAVE_TRT == 1 ]]; then
  for mode in aot jit; do
    copy="$OUT/trt-$mode"
    rm -rf "$copy" && cp -r "$ARTIFACT" "$copy" && rm -rf "$copy/engines"
    stage "trt-build-$mode" 150 "${CHECK[@]}" trt-build --artifact "$copy" --mode "$mode"
    stage "trt-compare-$mode" 90 "${CHECK[@]}" trt-compare --artifact "$copy" --max-new-tokens 32
  done
else
  log "TensorRT is not importable: stage d (build AOT/JIT engines, load, compare with ORT) skipped"
  SKIPPED+=("trt")
  for mode in aot jit; do  # what can run without TensorRT: the build plan
    $PY -m dspark_trt.cli build "$ARTIFACT" --dry-run --plugin-mode "$mode" > "$OUT/build-plan-$mode.json" \
      || FAILED+=("build-plan-$mode")
  done
fi

log "done in $((SECONDS - T_START))s; failed: ${FAILED[*]:-none}; skipped: ${SKIPPED[*]:-none}; log: $LOG"
[[ ${#FAILED[@]} -eq 0 ]]
