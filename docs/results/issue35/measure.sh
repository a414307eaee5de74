#!/usr/bin/env bash
# Issue 35's figures: the shape-true synthetic Qwen3-30B-A3B GGUFs (4 and 8 layers, random weights,
# Q4_K_M by llama.cpp's own converter and quantizer), specdec beside llama-bench on each, in one
# sitting. Run with nothing else running. Usage: LLAMA_CPP=<llama.cpp source tree with build/bin>
#   bash docs/results/issue35/measure.sh OUT_DIR [sitting-name]
set -euo pipefail
out=${1:?OUT_DIR}; name=${2:-a}
llama=${LLAMA_CPP:-$HOME/.cache/llama-cpp/llama_cpp_python-0.3.36/vendor/llama.cpp}
here=$(dirname "$0")
level=$(python -c "from specdec import native; print((native.simd_level() or native.SIMD_LEVELS[-1]).name)")
for layers in 4 8; do
  gguf="$out/moe$layers/qwen3moe-a3b-shapes-${layers}L-Q4_K_M.gguf"
  [ -f "$gguf" ] || python -m specdec.eval.moe_synthetic "$out/moe$layers" --layers "$layers" --llama-cpp "$llama"
  python -m specdec.eval.moe_bench "$gguf" --llama-bin "$llama/build/bin" --repeats 3 \
    --out "$here/${level}-${layers}L-$name"
done
