#!/usr/bin/env bash
# The GPU check, on a bare CUDA machine with torch, triton, transformers and pytest (no network, no
# `make setup`); the SmolLM2 model prepared in models/ (see docs/gpu.md). Within about 5 minutes, in
# order: the kernel and GPU tests; the decode / verify step benchmark for SmolLM2's and
# Llama-3.1-8B's shapes; every algorithm on 8 MT-bench prompts x 128 tokens with graphs on, pinned
# and adaptive, beside HF generate() with its static cache. Each part writes its file into OUT as
# it finishes (a timeout still returns what ran): summary.txt, check.log and one JSON/XML a part.
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
  timeout "$limit" "$@" >> "$OUT/check.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >> "$OUT/summary.txt" 2>&1

part tests 110 $PY -m pytest -q -p no:cacheprovider tests/kernels tests/gpu --junitxml="$OUT/tests.xml"
part steps-smollm2 30 $PY bench/gpu/run.py --shape smollm2-135m --context 1024 --batch-sizes 1,8,64 \
  --num-draft-tokens 8,16,32,64 --skip-variants --json "$OUT/steps_smollm2.json"
part steps-llama8b 45 $PY bench/gpu/run.py --shape llama-3.1-8b --context 1024 --batch-sizes 1,16,64 \
  --num-draft-tokens 8,16,32 --skip-variants --json "$OUT/steps_llama8b.json"
part variants 100 $PY bench/gpu/run.py --skip-steps --algorithms none,ngram,eagle,eagle3,mtp,standalone \
  --num-prompts 8 --max-new-tokens 128 --graphs-only --json "$OUT/variants.json"
part hf-static 60 $PY bench/gpu/run.py --skip-steps --algorithms none --no-adaptive --graphs-only \
  --num-prompts 8 --max-new-tokens 128 --hf-static --json "$OUT/hf_static.json"
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
