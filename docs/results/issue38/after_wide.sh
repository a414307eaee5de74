#!/usr/bin/env bash
# 0.21.0's 512-bit k-quant and Q5_0 passes at AVX-512 VNNI: the default pair on HumanEval and
# ShareGPT (target-only, speculative; the draft as re-quantized and read as stored) between two
# llama.cpp tg128 runs, then ours and llama.cpp's 512-token prefill alternated, in one sitting.
# Usage: LLAMA_BIN=<llama.cpp build/bin, AVX-512 build> bash after_wide.sh OUT_DIR. Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"; here=$(dirname "$0")
{ echo "SPECDEC_ISA=${SPECDEC_ISA:-} $(python -c 'from specdec import native; print(native.describe_simd())')"
  grep -o 'avx[^ ]*\|amx[^ ]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } | tee "$out/kernels.txt"
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | tee "$out/llama-bench.md"
for ds in humaneval sharegpt; do
  specdec bench latency --dataset $ds --limit 10 --max-tokens 128 --concurrency --threads 2 --out "$out/$ds" \
    --no-progress --systems specdec-target-only specdec-speculative 2>/dev/null | grep "^|" | tee "$out/$ds.md"
  specdec bench latency --dataset $ds --limit 10 --max-tokens 128 --concurrency --threads 2 --out "$out/$ds-draft-gguf" \
    --no-progress --systems specdec-speculative --draft-quant gguf 2>/dev/null | grep "^|" | tee "$out/$ds-draft-gguf.md"
done
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | tee -a "$out/llama-bench.md"
for i in 1 2; do  # ours and llama.cpp's prefill, alternated
  python "$here/prefill_512.py" gguf 2>/dev/null | tail -1 | tee -a "$out/prefill.txt"
  "$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 512 -n 0 -r 3 2>/dev/null | grep pp512 | tee -a "$out/prefill.txt"
done
