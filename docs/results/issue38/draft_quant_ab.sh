#!/usr/bin/env bash
# The draft re-quantized (w4a8) against read as stored (gguf): speculative decoding of the default
# pair on HumanEval and ShareGPT (10 prompts, 128 tokens, greedy), the two alternated twice, at the
# level SPECDEC_ISA names. Usage: SPECDEC_ISA=avx2 bash draft_quant_ab.sh OUT_DIR. Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"
python -c 'from specdec import native; print(native.describe_simd())' | tee "$out/kernels.txt"
for ds in humaneval sharegpt; do
  for i in 1 2; do
    for q in w4a8 gguf; do
      printf '%s %s round %s: ' "$ds" "$q" "$i" | tee -a "$out/ab.txt"
      specdec bench latency --dataset $ds --limit 10 --max-tokens 128 --concurrency --threads 2 --out "$out/$ds-$q-$i" \
        --no-progress --systems specdec-speculative --draft-quant $q 2>/dev/null | grep "^| specdec" | tee -a "$out/ab.txt"
    done
  done
done
