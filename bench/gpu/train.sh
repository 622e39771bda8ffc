#!/usr/bin/env bash
# Drafter training, one command on a bare CUDA machine (no network, no `make setup`), the SmolLM2
# model prepared in models/ (docs/gpu.md): the target's own answers generated on the device until
# the corpus holds ANSWER_TOKENS (default 3,000,000; a staged corpus .tar counts towards it), then
# the EAGLE-3, EAGLE-2 and MTP heads trained together, all inside MINUTES (default 7, the whole
# command). Each head comes back in OUT as tar parts of at most 16 MiB, beside the grown corpus
# (when it fits in 8 files), train-drafters.json and train.log.
#     bench/gpu/train.sh [OUT] [FILE ...]   FILE: a corpus .tar and/or a prompts .jsonl (export-prompts);
#                                           default: whatever of those lies in /root/stash/extra
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-results/gpu-train}}
shift || true
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(/root/stash/extra/*.tar /root/stash/extra/*.jsonl)
ARGS=()
for f in "${FILES[@]}"; do
  [ -e "$f" ] || continue
  case "$f" in
    *.tar) ARGS+=(--corpus "$f") ;;
    *.jsonl|*.json) ARGS+=(--prompts "$f") ;;
    *) echo "train.sh: $f is neither a corpus .tar nor a prompts .jsonl" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/backend:$PWD/kernels:$PWD/client"
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
$PY -m specserve.cli train-drafters "${ARGS[@]}" --out "$WORK" --archive-dir "$OUT" \
  --generate-answer-tokens "${ANSWER_TOKENS:-3000000}" --minutes "${MINUTES:-7}" --device "${DEVICE:-cuda}" \
  ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
exit "${PIPESTATUS[0]}"
