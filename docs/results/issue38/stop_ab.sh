#!/usr/bin/env bash
# The draft's early-stop confidence (`--draft-stop-confidence`): speculative decoding of the default
# pair on HumanEval and ShareGPT (10 prompts, 128 tokens, greedy) at each value given, alternated
# twice, at the level SPECDEC_ISA names. Usage: bash stop_ab.sh OUT_DIR P [P ...]. Nothing else may run.
set -euo pipefail
out=${1:?output folder}; shift; mkdir -p "$out"
python -c 'from specdec import native; print(native.describe_simd())' | tee "$out/kernels.txt"
for ds in humaneval sharegpt; do
  for i in 1 2; do
    for p in "$@"; do
      printf '%s stop %s round %s: ' "$ds" "$p" "$i" | tee -a "$out/ab.txt"
      specdec bench latency --dataset $ds --limit 10 --max-tokens 128 --concurrency --threads 2 --out "$out/$ds-$p-$i" \
        --no-progress --systems specdec-speculative --draft-stop-confidence "$p" 2>/dev/null | grep "^| specdec" | tee -a "$out/ab.txt"
    done
  done
done
