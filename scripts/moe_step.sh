#!/usr/bin/env bash
# The MoE step table (BENCHMARKS.md, "Mixture-of-experts targets"): random weights of public MoE shapes,
# int4 (QUANT=bf16: bf16) on the native path, slices of 2 and 4 layers extrapolated to the whole depth,
# T = 1..9 and the blocks a batch of 4 or 16 verifies; raw output and JSON in docs/bench/moe/ (bf16:
# docs/bench/moe-bf16/). Run alone on the machine.
#
#   bash scripts/moe_step.sh                 # SHAPES="olmoe-1b-7b ..." to choose shapes
set -euo pipefail
cd "$(dirname "$0")/.."
QUANT=${QUANT:-int4}
case $QUANT in
  int4) out=docs/bench/moe; qflag=(--quantization int4) ;;
  bf16) out=docs/bench/moe-bf16; qflag=() ;;
  *) echo "QUANT must be int4 or bf16, got $QUANT" >&2; exit 2 ;;
esac
mkdir -p "$out"
{ lscpu | grep "Model name"; grep -q avx512f /proc/cpuinfo && echo "AVX-512: yes" || echo "AVX-512: no (AVX2 only)"; echo "cores: $(nproc)"; date -u; } > "$out/machine.txt"
for shape in ${SHAPES:-olmoe-1b-7b qwen3-30b-a3b gpt-oss-20b}; do
  .venv/bin/python -m specdec.tools.bench.step --shape "$shape" --slices 2,4 "${qflag[@]}" --paths native \
    --rows 1,2,3,4,5,6,7,8,9,16,32,64 --repeats 5 --context 256 --output "$out/$shape.json" | tee "$out/$shape.txt"
done
