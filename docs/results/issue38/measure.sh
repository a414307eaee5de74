#!/usr/bin/env bash
# Issue 38's side-by-side in one sitting: llama.cpp (built by ../shared/tools/build-llama-cpp.sh at
# the same level) against specdec before (v0.15's defaults: target w4a8-auto, full draft head) and
# after (target gguf: the file's Q4_K / Q6_K blocks; draft head over 32,768 ids), plus the draft
# vocabulary's sizes. Usage: LLAMA_BIN=<llama.cpp build/bin> bash measure.sh OUT_DIR
# Needs /tmp/target.gguf and /tmp/draft.gguf (the default pair's GGUFs). Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
bench() {  # name dataset systems... -- engine flags...
  local name=$1 dataset=$2; shift 2
  specdec bench latency --dataset "$dataset" --limit 10 --max-tokens 128 --concurrency --threads 2 \
    --out "$out/$name" --no-progress "$@" 2>/dev/null | grep "^|" | tee "$out/$name.md"
}
echo "SPECDEC_ISA=${SPECDEC_ISA:-} $(python -c 'from specdec import native; print(native.describe_simd())')" | tee "$out/kernels.txt"
python -m specdec.eval.roofline | tee "$out/roofline.md"
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 512 -n 128 -r 3 2>/dev/null | tee "$out/llama-bench.md"
for ds in humaneval sharegpt; do
  bench "$ds-before" $ds --systems specdec-target-only specdec-speculative --target-quant w4a8-auto --draft-vocab full
  bench "$ds-after" $ds --systems specdec-target-only specdec-speculative
  for size in full 16384; do
    bench "$ds-vocab-$size" $ds --systems specdec-speculative --draft-vocab $size
  done
done
LLAMA_BIN="$LLAMA_BIN" python "$here/../issue26/llama_spec.py" 3 10 | tail -1 | tee "$out/llama-speculative.txt"
for mode in w4a8-auto gguf; do python "$here/prefill_512.py" $mode | tail -1 | tee -a "$out/prefill.txt"; done
for i in 1 2; do  # a gguf target is read from the GGUF at every load: each is a first load
  /usr/bin/time -v specdec generate --max-tokens 1 --no-warmup "def f():" 2>&1 \
    | grep -E "loaded in|Maximum resident" | tee -a "$out/load.txt"
done
