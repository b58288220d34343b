#!/usr/bin/env bash
# The families' step table (issue: the models users bring), one shape after another in one run (never two
# at once): random weights of each public shape through the native forward, T = 1 and T = 4 rows, against
# the machine's read bandwidth measured in each run. Qwen2.5-1.5B is the reference row of the same run.
# Every shape at its whole depth (slices extrapolated to the depth multiplied their noise by 3.7-4.7; the
# largest, Qwen3-4B in bf16, holds 11.5 GB), Gemma 3 at 1k, 4k and 8k of context (its windowed layers read
# 1k keys at any). The reference is measured again after every two shapes (-r2, -r3, ...), so each row has
# a reference beside it in time on a host whose speed drifts. The limit counts the weights and the cached
# keys and values a forward reads. Last, the 0.5B int4 draft's step (the --draft of python -m specdec.tools.bench.projection).
#
#   bash scripts/families_step.sh [OUT_DIR] [ROWS]   # default docs/bench/families-whole; ROWS: a regex of the
#                                                    # rows' names to run (default: all)
#   python -m specdec.tools.bench.families_table OUT_DIR   # the Markdown table, rows in the order they ran
#                                                         # (OUT_DIR/order.txt: a name per line as each ends)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/families-whole}
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
  echo "$name" >> "$OUT/order.txt"
}
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags:.*\(avx512[a-z_]*\).*/Flags: has AVX-512/; s/^Flags:.*/Flags: (no AVX-512)/' > "$OUT/machine.txt"
ref() {  # the reference row again (QUANT, N)
  if [[ $1 == int4 ]]; then run "qwen2.5-1.5b-int4-r$2" --shape qwen2.5-1.5b --quantization int4
  else run "qwen2.5-1.5b-bf16-r$2" --shape qwen2.5-1.5b; fi
}
run qwen2.5-1.5b-int4 --shape qwen2.5-1.5b --quantization int4
run qwen3-1.7b-int4 --shape qwen3-1.7b --quantization int4
run qwen3-4b-int4 --shape qwen3-4b --quantization int4
ref int4 2
run llama-3.2-3b-int4 --shape llama-3.2-3b --quantization int4
run phi-4-mini-int4 --shape phi-4-mini --quantization int4
ref int4 3
run smollm3-3b-int4 --shape smollm3-3b --quantization int4
run gemma-3-4b-int4-c1k --shape gemma-3-4b --quantization int4 --context 1024
ref int4 4
run gemma-3-4b-int4-c4k --shape gemma-3-4b --quantization int4 --context 4096
run gemma-3-4b-int4-c8k --shape gemma-3-4b --quantization int4 --context 8192
ref int4 5
run qwen2.5-1.5b-bf16 --shape qwen2.5-1.5b
run qwen3-1.7b-bf16 --shape qwen3-1.7b
run qwen3-4b-bf16 --shape qwen3-4b
ref bf16 2
run llama-3.2-3b-bf16 --shape llama-3.2-3b
run phi-4-mini-bf16 --shape phi-4-mini
ref bf16 3
run smollm3-3b-bf16 --shape smollm3-3b
run gemma-3-4b-bf16-c1k --shape gemma-3-4b --context 1024
ref bf16 4
run gemma-3-4b-bf16-c4k --shape gemma-3-4b --context 4096
ref bf16 5
run qwen2.5-0.5b-int4-draft --shape qwen2.5-0.5b --quantization int4
