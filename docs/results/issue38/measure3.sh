#!/usr/bin/env bash
# Issue 38's goals at one kernel level, in one sitting beside llama.cpp built for the same level:
# loads (a first load with a fresh cache, a later one) and their peak RSS, the bytes a token per the
# roofline, prefill of 512 tokens against pp512 (alternated), llama.cpp's tg128 and speculative
# mode, and the default pair target-only and speculative on HumanEval and ShareGPT (and speculative
# with the draft read as stored, --draft-quant gguf: no re-quantization at its first load).
# Usage: [SPECDEC_ISA=avx2] LLAMA_BIN=<llama.cpp build/bin for that level> bash measure3.sh OUT_DIR
# Needs /tmp/target.gguf and /tmp/draft.gguf (the default pair's GGUFs). Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"; out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
cache=${SPECDEC_CACHE:-$HOME/.cache/specdec}
fresh() {  # a cache folder with the models, GGUFs and built kernels but nothing derived from weights
  local d; d=$(mktemp -d); for sub in gguf models kernels; do [ -e "$cache/$sub" ] && ln -s "$cache/$sub" "$d/$sub"; done; echo "$d"
}
load() {  # label, then flags for specdec generate
  local label=$1; shift
  /usr/bin/time -v specdec generate --max-tokens 1 --no-warmup "$@" "def f():" 2>&1 \
    | grep -E "loaded in|Maximum resident" | tr '\n' ' ' | sed "s/^/$label: /" | tee -a "$out/load.txt"; echo | tee -a "$out/load.txt"
}
bench() {  # name dataset, then flags for specdec bench latency
  local name=$1 dataset=$2; shift 2
  specdec bench latency --dataset "$dataset" --limit 10 --max-tokens 128 --concurrency --threads 2 \
    --out "$out/$name" --no-progress "$@" 2>/dev/null | grep "^|" | tee "$out/$name.md"
}
{ echo "SPECDEC_ISA=${SPECDEC_ISA:-} $(python -c 'from specdec import native; print(native.describe_simd())')"
  grep -o 'avx[^ ]*\|amx[^ ]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } | tee "$out/kernels.txt"
load "later load"  # first, so that this level's kernels are built before the fresh-cache load
SPECDEC_CACHE=$(fresh) load "first load"
SPECDEC_CACHE=$(fresh) load "first load, --draft-quant gguf" --draft-quant gguf
load "later load"
for q in w4a8 gguf; do python -m specdec.eval.roofline --draft-quant $q | tee "$out/roofline-draft-$q.md"; done
for i in 1 2; do  # ours and llama.cpp's prefill, alternated
  python "$here/prefill_512.py" gguf 2>/dev/null | tail -1 | tee -a "$out/prefill.txt"
  "$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 512 -n 0 -r 3 2>/dev/null | grep pp512 | tee -a "$out/prefill.txt"
done
"$LLAMA_BIN/llama-bench" -m /tmp/target.gguf -t 2 -p 0 -n 128 -r 3 2>/dev/null | tee "$out/llama-bench.md"
for ds in humaneval sharegpt; do
  bench "$ds" $ds --systems specdec-target-only specdec-speculative
  bench "$ds-draft-gguf" $ds --systems specdec-speculative --draft-quant gguf
done
LLAMA_BIN="$LLAMA_BIN" python "$here/../issue26/llama_spec.py" 3 10 | tail -1 | tee "$out/llama-speculative.txt"
