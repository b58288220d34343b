"""Prefill speed of one prompt: one-shot products (512-token chunks: oneDNN, PyTorch's fused attention)
against the native path (32-token chunks grouped 512 per forward), each twice, in one process.

    python scripts/prefill_paths.py smollm2-135m bf16 3000
"""
import sys, time, torch
from specdec import LLM
name, quant, n = sys.argv[1], (sys.argv[2] if sys.argv[2] != "bf16" else None), int(sys.argv[3])
llm = LLM(model=name, quantization=quant, progress=False, enable_prefix_caching=False, max_num_seqs=1)
r = llm.runner
ids = [(i * 7919) % 30000 + 100 for i in range(n)]
core = llm.engine(0); core.reserve(1, n + 64)
for chunk in (512, 32, 512, 32):
    r.prefill_chunk = chunk
    t0 = time.perf_counter()
    with torch.inference_mode():
        r.prefill(0, ids, start=0)
    dt = time.perf_counter() - t0
    print(f"{name} {quant or 'bf16'} {n} tokens chunk {chunk}: {n/dt:.0f} tok/s", flush=True)
