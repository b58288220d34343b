#!/usr/bin/env bash
# The MoE step table (BENCHMARKS.md, "Mixture-of-experts targets"): random weights of public MoE shapes,
# int4 on the native path, slices of 2 and 4 layers extrapolated to the whole depth, T = 1..9 and the
# blocks a batch of 4 or 16 verifies; raw output and JSON in docs/bench/moe/. Run alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/moe
mkdir -p "$out"
{ lscpu | grep "Model name"; grep -q avx512f /proc/cpuinfo && echo "AVX-512: yes" || echo "AVX-512: no (AVX2 only)"; echo "cores: $(nproc)"; date -u; } > "$out/machine.txt"
for shape in ${SHAPES:-olmoe-1b-7b qwen3-30b-a3b gpt-oss-20b}; do
  .venv/bin/python -m specdec.tools.bench.step --shape "$shape" --slices 2,4 --quantization int4 --paths native \
    --rows 1,2,3,4,5,6,7,8,9,16,32,64 --repeats 5 --context 256 --output "$out/$shape.json" | tee "$out/$shape.txt"
done
