#!/usr/bin/env bash
# 0.21.1 (AVX2 Q5_0 passes of 3 rows; a GGUF draft read as stored by default at every level): the
# default pair's loads (fresh cache: nothing derived from weights), then HumanEval and ShareGPT
# (target-only, speculative) between two llama.cpp tg128 runs, then ours and llama.cpp's 512-token
# prefill alternated, in one sitting at the level SPECDEC_ISA names.
# Usage: LLAMA_BIN=<llama.cpp build/bin for the level> bash after_q50.sh OUT_DIR. Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"; out=$(cd "$out" && pwd); here=$(cd "$(dirname "$0")" && pwd)
cache=${SPECDEC_CACHE:-$HOME/.cache/specdec}
fresh() {  # a cache folder with the models, GGUFs and built kernels but nothing derived from weights
  local d; d=$(mktemp -d); for sub in gguf models kernels; do [ -e "$cache/$sub" ] && ln -s "$cache/$sub" "$d/$sub"; done; echo "$d"
}
load() {  # label, then flags for specdec generate
  local label=$1; shift
  /usr/bin/time -v specdec generate --max-tokens 1 --no-warmup "$@" "def f():" 2>&1 \
    | grep -E "loaded in|Maximum resident" | tr '\n' ' ' | sed "s/^/$label: /" | tee -a "$out/load.txt"; echo | tee -a "$out/load.txt"
}
{ echo "SPECDEC_ISA=${SPECDEC_ISA:-} $(python -c 'from specdec import native; print(native.describe_simd())')"
  grep -o 'avx[^ ]*\|amx[^ ]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } | tee "$out/kernels.txt"
load "later load"  # first, so that this level's kernels are built before the fresh-cache loads
SPECDEC_CACHE=$(fresh) load "first load (default)"
SPECDEC_CACHE=$(fresh) load "first load, --draft-quant w4a8" --draft-quant w4a8
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | tee "$out/llama-bench.md"
for ds in humaneval sharegpt; do
  specdec bench latency --dataset $ds --limit 10 --max-tokens 128 --concurrency --threads 2 --out "$out/$ds" \
    --no-progress --systems specdec-target-only specdec-speculative 2>/dev/null | grep "^|" | tee "$out/$ds.md"
done
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | tee -a "$out/llama-bench.md"
for i in 1 2; do  # ours and llama.cpp's prefill, alternated
  python "$here/prefill_512.py" gguf 2>/dev/null | tail -1 | tee -a "$out/prefill.txt"
  "$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 512 -n 0 -r 3 2>/dev/null | grep pp512 | tee -a "$out/prefill.txt"
done
python -m specdec.eval.roofline 2>/dev/null | grep -v "^load" > "$out/roofline.md" || true
