#!/usr/bin/env bash
# 0.20.3's vpdpbusd k-quant path at AVX-512 VNNI: the default pair on HumanEval and ShareGPT
# (target-only, speculative) between two llama.cpp tg128 runs, in one sitting.
# Usage: LLAMA_BIN=<llama.cpp build/bin, AVX-512 build> bash after_vnni.sh OUT_DIR. Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | tee "$out/llama-bench.md"
for ds in humaneval sharegpt; do
  specdec bench latency --dataset $ds --limit 10 --max-tokens 128 --concurrency --threads 2 --out "$out/$ds" \
    --no-progress --systems specdec-target-only specdec-speculative 2>/dev/null | grep "^|" | tee "$out/$ds.md"
done
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | tee -a "$out/llama-bench.md"
