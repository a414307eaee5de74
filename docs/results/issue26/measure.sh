#!/usr/bin/env bash
# Issue 26's side-by-side on one quiet machine: llama.cpp (built by ../shared/tools/build-llama-cpp.sh
# at the same ISA level, e.g. LLAMA_AVX512=OFF for the AVX2 level) against specdec held to a level.
# Usage: LLAMA_BIN=<llama.cpp build/bin> SPECDEC_ISA=avx2 bash docs/results/issue26/measure.sh OUT_DIR
# Needs /tmp/target.gguf and /tmp/draft.gguf: the default pair's chunks concatenated (see
# docs/results/issue26.md). Check `uptime` first: nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"
here=$(dirname "$0")
echo "SPECDEC_ISA=${SPECDEC_ISA:-} $(python -c 'from specdec import native; print(native.describe_simd())')" | tee "$out/kernels.txt"
python -m specdec.eval.roofline | tee "$out/roofline.md"
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 512 -n 128 -r 3 2>/dev/null | tee "$out/llama-bench.md"
specdec bench latency --limit 10 --max-tokens 128 --systems specdec-target-only specdec-speculative \
  --concurrency --threads 2 --out "$out/humaneval" --no-progress | grep "^|"
specdec bench latency --dataset sharegpt --limit 10 --max-tokens 128 --systems specdec-target-only \
  specdec-speculative --concurrency --threads 2 --out "$out/sharegpt" --no-progress | grep "^|"
LLAMA_BIN="$LLAMA_BIN" python "$here/llama_spec.py" 3 10 | tail -1 | tee "$out/llama-speculative.txt"
python "$here/prefill_512.py" | tail -1 | tee "$out/prefill.txt"
