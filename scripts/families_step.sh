#!/usr/bin/env bash
# The families' step table (issue: the models users bring), one shape after another in one run (never two
# at once): random weights of each public shape through the native forward, T = 1 and T = 4 rows, against
# the machine's read bandwidth measured in each run. Qwen2.5-1.5B is the reference row of the same run.
# Shapes up to 2B at whole depth; the 3-4B shapes as two slices extrapolated to their depth (--slices),
# Gemma 3 at its whole depth (slices' difference times 4.7 made its rows noisy) at 1k, 4k and 8k of context
# (its windowed layers read 1k keys at any). The limit counts the weights and the cached keys and values a
# forward reads.
#
#   bash scripts/families_step.sh [OUT_DIR] [ROWS]   # default docs/bench/families; ROWS: a regex of the
#                                                    # rows' names to run (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/families}
ROWS=${2:-.}
mkdir -p "$OUT"
PY=.venv/bin/python
run() {  # NAME ARGS...: one step table, its text and JSON under $OUT
  local name=$1
  shift
  [[ $name =~ $ROWS ]] || return 0
  echo "== $name: $*" | tee "$OUT/$name.txt"
  "$PY" -m specdec.tools.bench.step --paths native --rows 1,4 --repeats 11 --output "$OUT/$name.json" "$@" \
    2>&1 | grep -v '^\[transformers\]' | tee -a "$OUT/$name.txt"
}
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags:.*\(avx512[a-z_]*\).*/Flags: has AVX-512/; s/^Flags:.*/Flags: (no AVX-512)/' > "$OUT/machine.txt"
run qwen2.5-1.5b-int4 --shape qwen2.5-1.5b --quantization int4
run qwen3-1.7b-int4 --shape qwen3-1.7b --quantization int4
run qwen3-4b-int4 --shape qwen3-4b --quantization int4 --slices 4,8
run llama-3.2-3b-int4 --shape llama-3.2-3b --quantization int4 --slices 4,8
run phi-4-mini-int4 --shape phi-4-mini --quantization int4 --slices 4,8
run smollm3-3b-int4 --shape smollm3-3b --quantization int4 --slices 4,8
run gemma-3-4b-int4-c1k --shape gemma-3-4b --quantization int4 --context 1024
run gemma-3-4b-int4-c4k --shape gemma-3-4b --quantization int4 --context 4096
run gemma-3-4b-int4-c8k --shape gemma-3-4b --quantization int4 --context 8192
run qwen2.5-1.5b-bf16 --shape qwen2.5-1.5b
run qwen3-1.7b-bf16 --shape qwen3-1.7b
run qwen3-4b-bf16 --shape qwen3-4b --slices 4,8
run llama-3.2-3b-bf16 --shape llama-3.2-3b --slices 4,8
run phi-4-mini-bf16 --shape phi-4-mini --slices 4,8
run smollm3-3b-bf16 --shape smollm3-3b --slices 4,8
run gemma-3-4b-bf16-c1k --shape gemma-3-4b --context 1024
