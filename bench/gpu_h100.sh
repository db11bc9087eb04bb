#!/usr/bin/env bash
# The GPU tests and every GPU row on one H100 or H200, in one command, under 9 minutes.
#
#   bash bench/gpu_h100.sh            # on the GPU machine, from the repository root
#   bash bench/gpu_h100.sh --smoke    # on a CPU: tiny shapes, results in a temporary folder
#   bash bench/gpu_h100.sh --dry-run  # print the steps and their time limits, run nothing
#
# Steps, each under its own time limit (a stuck step loses its own rows only):
#   1. tests/test_gpu.py, test_tokamax.py, test_torch_peer.py      -> gpu_TAG_tests.log
#   2. python -m bench.gpu --sweep: mosaic_gpu's block configs (bench.gpu_runs.gpu SWEEP: the
#      warp-specialized kernels' and JAX's) at G = 8, 32, 128, each checked against the
#      first, and torch._grouped_mm on the same values              -> gpu_TAG_sweep.{json,md}
#   3. python -m bench.gpu: auto and torch._grouped_mm (tokamax too where its wheels are
#      in .whl/) at G = 8, 32, 128, uniform sizes                    -> gpu_TAG_gmm.{json,md}
#   4. python -m bench, the layer at E=8 and E=64 (T=32768, D=2048, F=4096, bf16): auto and
#      torch_moe                        -> gpu_TAG_layer.{json,md}, gpu_TAG_layer_e64.*
#   5. the summary (`python -m bench.gpu_runs.gpu_summary`): the ratios to torch.
# Results go to bench/results/ (RESULTS overrides) and, where $OUT is set (the device
# tool), to $OUT as well. tokamax travels as wheels in .whl/ (bench/gpu_wheels.sh fetches
# them here); where they are missing its rows say why.
set -u
cd "$(dirname "$0")/.."
MODE=${1:-run}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX and PyTorch share the GPU: JAX allocates as it goes instead of taking 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

if [ "$MODE" = --smoke ]; then
  RESULTS=${RESULTS:-$(mktemp -d)}
  T=256 D=64 F=128 REPEATS=2 GMM="--shape 512,64,128 --groups 4,8" SWEEP_G="4,8 --shape 512,256,512"
  TESTS_T=120 SWEEP_T=240 GMM_T=120 LAYER_T=240 LAYER64_T=240
  export JAX_PLATFORMS=cpu
else
  [ "$MODE" = --dry-run ] && RESULTS=${RESULTS:-$(mktemp -d)}
  RESULTS=${RESULTS:-bench/results}
  # Limits: 140 + 130 + 60 + 90 + 90 s of steps and about 20 s of setup, under 9 minutes.
  # Measured on an H200: 94 s of tests (before the warp-specialized kernels' cases), 67 s of
  # grouped matmuls (four impls), 137 and 114 s of layer rows (five and four impls).
  T=32768 D=2048 F=4096 REPEATS=10 GMM="--groups 8,32,128" SWEEP_G=8,32,128
  TESTS_T=140 SWEEP_T=130 GMM_T=60 LAYER_T=90 LAYER64_T=90
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
fi
mkdir -p "$RESULTS"
# Files are named after the card that ran them: gpu_h100_* on an H100, gpu_h200_* on an H200.
TAG=${GPU_TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
  grep -oiE 'h[0-9]{3}' | head -1 | tr 'H' 'h')}
TAG=${TAG:-h100}
LOG="$RESULTS/gpu_${TAG}_tests.log"

step() {  # step SECONDS NAME COMMAND...: runs COMMAND under a time limit, says how it ended
  local limit=$1 name=$2
  shift 2
  if [ "$MODE" = --dry-run ]; then
    echo "[${limit}s] $name: $*"
    return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s$([ $rc = 124 ] && echo ', TIMED OUT')"
}

if [ "$MODE" != --dry-run ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ "$MODE" != --dry-run ]; then
  "$PY" -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tail -1
  "$PY" -c "import tokamax; print('tokamax imports')" 2>&1 | tail -1
fi

# 1. Tests. XLA's GEMM autotuning only picks faster kernels: off for the tests' compiles.
# `-o addopts=`: the project's pytest options left out (-rs prints the skips). A test stuck
# on the GPU ends the step (pytest-timeout, where installed).
TIMEOUT=
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout=60 --timeout-method=thread"
# shellcheck disable=SC2086
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  step "$TESTS_T" tests "$PY" -m pytest -q -rs --durations=10 -p no:cacheprovider -o addopts= \
  $TIMEOUT tests/test_gpu.py tests/test_tokamax.py tests/test_torch_peer.py 2>&1 | tee "$LOG"
# 2. mosaic_gpu's block configs, each checked against the first, beside torch._grouped_mm.
# shellcheck disable=SC2086
step "$SWEEP_T" sweep "$PY" -m bench.gpu_runs.gpu --sweep $SWEEP_G --repeats 5 \
  --out "$RESULTS/gpu_${TAG}_sweep"
# 3. Grouped matmul against torch._grouped_mm (ragged_dot's rows: bench/results, earlier).
GMM_IMPLS=auto,torch
ls .whl/tokamax-*.whl >/dev/null 2>&1 && GMM_IMPLS=auto,tokamax,torch
# shellcheck disable=SC2086
step "$GMM_T" gmm "$PY" -m bench.gpu_runs.gpu $GMM --repeats "$REPEATS" \
  --impls "$GMM_IMPLS" --sizes uniform --out "$RESULTS/gpu_${TAG}_gmm"
# 4. The layer against the torchtitan-style PyTorch layer, one file per E, 5 timed calls
# each (compiling the programs takes most of the step).
for E in 8 64; do
  stem="$RESULTS/gpu_${TAG}_layer" limit=$LAYER_T
  [ "$E" = 64 ] && stem="${stem}_e64" limit=$LAYER64_T
  step "$limit" "layer E=$E" "$PY" -m bench -T "$T" -D "$D" -F "$F" -E "$E" \
    --dtype bfloat16 --levels layer --modes fwd,fwd_bwd --repeats 5 --mesh 1x1 \
    --impls auto,torch_moe --no-progress --out "$stem"
done
[ "$MODE" = --dry-run ] && exit 0

# 5. Summary; results to $OUT for the device tool (at most 8 files come back: one archive).
"$PY" -m bench.gpu_runs.gpu_summary "$RESULTS" --tag "$TAG" --tests "$LOG" | tee "$RESULTS/gpu_${TAG}_summary.txt"
if [ -n "${OUT:-}" ]; then
  (cd "$RESULTS" && tar czf "$OUT/gpu_${TAG}_results.tgz" gpu_"$TAG"_{tests.log,summary.txt} \
    $(ls gpu_"$TAG"_{sweep,gmm,layer,layer_e64}.{json,md} 2>/dev/null))
fi
echo "results in $RESULTS"
