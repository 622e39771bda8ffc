#!/usr/bin/env bash
# The GPU check, on a bare CUDA machine with torch, triton, transformers and pytest (no network, no
# `make setup`); the SmolLM2 model prepared in models/ (see docs/gpu.md). Within 5 minutes from cold
# caches, in order: the Triton kernels' tests on CUDA; the GPU tests (CUDA graphs, every algorithm
# lossless in float32); the decode / verify step benchmark for SmolLM2's and Llama-3.1-8B's shapes;
# every algorithm on 8 MT-bench prompts x 128 tokens with graphs on, pinned and adaptive; HF
# generate() with its static cache. Each part writes its file into OUT as it finishes (a timeout
# still returns what ran): summary.txt, check.log and one JSON/XML a part. A part past its limit
# gets SIGINT first, so pytest still writes its report.
#     bench/gpu/check.sh [OUT]        (default results/gpu-check)
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-results/gpu-check}}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/backend:$PWD/kernels:$PWD/client"
PY=${PYTHON:-python3}
start=$(date +%s)
: > "$OUT/summary.txt"

part() {  # part NAME SECONDS CMD...: run, log, record its exit status and the time so far
  local name=$1 limit=$2; shift 2
  echo "== $name ($*)" >> "$OUT/check.log"
  timeout -s INT -k 15 "$limit" "$@" >> "$OUT/check.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >> "$OUT/summary.txt" 2>&1

# Limits (300 s in all): a cold start compiles each Triton kernel on its first launch (1-4 s each)
# and captures every CUDA-graph bucket; the CPU-only kernel tests (the AVX2 few-row GEMM, the
# compile check for GPUs that are not there) are left out.
PYTEST="$PY -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60"
part kernels 70 $PYTEST tests/kernels --ignore=tests/kernels/test_few_row_gemm.py \
  --ignore=tests/kernels/test_real_compiler.py --junitxml="$OUT/kernels.xml"
part gpu-tests 60 $PYTEST -m gpu tests/gpu --junitxml="$OUT/gpu_tests.xml"
part steps-smollm2 25 $PY bench/gpu/run.py --shape smollm2-135m --context 1024 --batch-sizes 1,8,64 \
  --num-draft-tokens 8,16,32,64 --skip-variants --json "$OUT/steps_smollm2.json"
part steps-llama8b 35 $PY bench/gpu/run.py --shape llama-3.1-8b --context 1024 --batch-sizes 1,16,64 \
  --num-draft-tokens 8,16,32 --skip-variants --json "$OUT/steps_llama8b.json"
part variants 75 $PY bench/gpu/run.py --skip-steps --algorithms none,ngram,eagle,eagle3,mtp,standalone \
  --num-prompts 8 --max-new-tokens 128 --graphs-only --json "$OUT/variants.json"
part hf-static 35 $PY bench/gpu/run.py --skip-steps --algorithms none --no-adaptive --graphs-only \
  --num-prompts 8 --max-new-tokens 128 --hf-static --json "$OUT/hf_static.json"
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
