#!/usr/bin/env bash
# First load of the default pair from an empty cache, then two later loads, on a quiet machine.
# Usage: bash docs/results/v0.9.0/first_load.sh [cache folder] [site folder]
#   cache folder: default a new temporary one; site folder: run the specdec installed there
#   (`pip install --no-deps --target DIR <checkout>`) instead of this checkout, for a side-by-side "before".
set -euo pipefail
export SPECDEC_CACHE="${1:-$(mktemp -d)}"
[ -n "${2:-}" ] && { export PYTHONPATH="$2"; cd "$2"; }  # cd: a checkout's own ./specdec would come first
echo "cache: $SPECDEC_CACHE (empty: $(ls -A "$SPECDEC_CACHE" | wc -l) entries); code: $(python -c 'import specdec, os; print(os.path.dirname(specdec.__file__))')"
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(could not drop the page cache)"; }
run() { /usr/bin/time -f "real %e s, max RSS %M KB" python -m specdec.api.cli generate "def fib(n):" --max-tokens 32 --temperature 0 2>&1 \
        | tr '\r' '\n' | grep -E "^specdec:|loaded in|tok/s|real .* s" ; }
echo "== first load (page cache dropped) =="; drop; run
echo "== cache =="; du -s --block-size=1 "$SPECDEC_CACHE"; du -sh "$SPECDEC_CACHE"/*
python - <<PY
gguf = 1_117_320_768 + 491_400_064
import subprocess
used = int(subprocess.check_output(["du", "-s", "--block-size=1", "$SPECDEC_CACHE"]).split()[0])
print(f"cache / GGUF size = {used:,} / {gguf:,} = {used / gguf:.3f}x")
PY
echo "== later load (page cache dropped) =="; drop; run
echo "== later load (page cache warm) =="; run
