#!/usr/bin/env bash
# Issue 38, second round (0.16.1), in one sitting: load time and peak RSS (first load with a fresh
# quantized cache, later load), prefill of 512 tokens beside llama.cpp's pp512, the draft read as
# stored (--draft-quant gguf: its Q5_0 / Q8_0 / Q4_K / Q6_K blocks) against the re-quantized w4a8
# draft, and the default pair beside llama.cpp's best mode. BEFORE_TREE: a checkout of v0.16.0
# (bba5ce3) for its load and prefill; it is installed (editable) for those runs, then this one.
# Usage: LLAMA_BIN=<llama.cpp build/bin> BEFORE_TREE=<dir> bash measure2.sh OUT_DIR
# Needs /tmp/target.gguf and /tmp/draft.gguf (the default pair's GGUFs). Nothing else may run.
set -euo pipefail
out=${1:?output folder}; mkdir -p "$out"; out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd)
cache=${SPECDEC_CACHE:-$HOME/.cache/specdec}
fresh() {  # a cache folder with the models, GGUFs and built kernels but no quantized weights
  local d; d=$(mktemp -d); for sub in gguf models kernels; do ln -s "$cache/$sub" "$d/$sub"; done; echo "$d"
}
load() {  # label, then flags for specdec generate
  local label=$1; shift
  /usr/bin/time -v specdec generate --max-tokens 1 --no-warmup "$@" "def f():" 2>&1 \
    | grep -E "loaded in|Maximum resident" | tr '\n' ' ' | sed "s/^/$label: /" | tee -a "$out/load.txt"; echo | tee -a "$out/load.txt"
}
bench() {  # name dataset systems... -- engine flags...
  local name=$1 dataset=$2; shift 2
  specdec bench latency --dataset "$dataset" --limit 10 --max-tokens 128 --concurrency --threads 2 \
    --out "$out/$name" --no-progress "$@" 2>/dev/null | grep "^|" | tee "$out/$name.md"
}
echo "SPECDEC_ISA=${SPECDEC_ISA:-} $(python -c 'from specdec import native; print(native.describe_simd())')" | tee "$out/kernels.txt"
# before: v0.16.0
pip install -q --no-deps -e "$BEFORE_TREE" 2>/dev/null
load "v0.16.0 later load"  # first, so that its kernels are built before the fresh-cache load
SPECDEC_CACHE=$(fresh) load "v0.16.0 first load"
(cd "$BEFORE_TREE" && python docs/results/issue38/prefill_512.py gguf 2>/dev/null | tail -1 | sed 's/^/v0.16.0 /' | tee -a "$out/prefill.txt")
pip install -q --no-deps -e "$root" 2>/dev/null
# after
load "later load"
SPECDEC_CACHE=$(fresh) load "first load"
SPECDEC_CACHE=$(fresh) load "first load, --draft-quant gguf" --draft-quant gguf
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
