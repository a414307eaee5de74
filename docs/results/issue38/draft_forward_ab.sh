#!/usr/bin/env bash
# The default draft's forward (read as stored) with the kernel sources of git ref $1 against this
# checkout's, alternated 3 times at the level SPECDEC_ISA names (the kernels rebuild by hash).
# Usage: SPECDEC_ISA=avx2 bash draft_forward_ab.sh REF [ROWS...]
set -euo pipefail
ref=$1; shift; rows=${*:-1 2 3 4 6 8 12}
here=$(dirname "$0"); patch=$(mktemp)
git diff "$ref" -- target/quant specdec/simd.h > "$patch"
trap 'git apply "$patch" 2>/dev/null || true; rm -f "$patch"' EXIT
for i in 1 2 3; do
  git apply -R "$patch"; python "$here/draft_forward.py" gguf "$ref" $rows 2>/dev/null
  git apply "$patch"; python "$here/draft_forward.py" gguf this $rows 2>/dev/null
done
trap - EXIT; rm -f "$patch"
