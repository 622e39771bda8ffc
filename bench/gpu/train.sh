#!/usr/bin/env bash
# Drafter training, one command on a bare CUDA machine (no network, no `make setup`), the SmolLM2
# model prepared in models/ (docs/gpu.md) and a regenerate-data corpus staged as a .tar: the
# EAGLE-3, EAGLE-2 and MTP heads trained together inside MINUTES (default 6, the whole command),
# each written into OUT as tar parts of at most 16 MiB beside train-drafters.json and train.log.
#     bench/gpu/train.sh [OUT] [CORPUS]   (defaults results/gpu-train, /root/stash/extra/corpus.tar)
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-results/gpu-train}}
CORPUS=${2:-/root/stash/extra/corpus.tar}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/backend:$PWD/kernels:$PWD/client"
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
$PY -m specserve.cli train-drafters --corpus "$CORPUS" --out "$WORK" --archive-dir "$OUT" \
  --minutes "${MINUTES:-6}" --device "${DEVICE:-cuda}" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
exit "${PIPESTATUS[0]}"
