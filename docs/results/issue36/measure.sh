#!/usr/bin/env bash
# Prefill/decode disaggregation beside colocated serving, default pair, one sitting, nothing else
# running: `specdec bench serve --pd` starts each layout's `specdec serve` itself, one at a time.
#   bash docs/results/issue36/measure.sh OUT_DIR
# The long-arrival run (3 prompts of 1536 tokens, 25 s apart, while 2 streams decode) and the
# short, low-load run (6 prompts of 32 tokens, one at a time) for each layout: pd, colocated, plain.
set -euo pipefail
out=${1:?usage: measure.sh OUT_DIR}
mkdir -p "$out"
{ date -u; git rev-parse HEAD; grep -o 'avx[^ ]*\|amx[^ ]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; nproc; } > "$out/machine.txt"
specdec bench serve --pd --layouts pd colocated plain --out "$out" 2>&1 | tee "$out/bench.log"
