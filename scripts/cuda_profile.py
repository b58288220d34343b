"""Where one CUDA forward's time goes (scripts/cuda_checks.sh runs it on a lent GPU): a random-weight
model of a real shape on the engine's PyTorch path, one token after a 256-token context; wall time,
the GPU's busy time (CUDA events) and the operators that take the host's time, from PyTorch's profiler."""
from __future__ import annotations

import sys
import time

import torch

from specdec.tools.bench.step import random_model


def main(shape: str = "qwen2.5-1.5b") -> None:
    model = random_model(shape, int(sys.argv[2]) if len(sys.argv) > 2 else 28, None, False, "cuda")
    cache = model.new_cache(1, 300)
    toks = torch.randint(0, model.config.vocab_size, (1, 257), device="cuda")
    with torch.inference_mode():
        model(toks[:, :256], torch.arange(256, device="cuda")[None], cache)
        block, pos = toks[:, 256:], torch.arange(256, 257, device="cuda")[None]
        for _ in range(3):
            model(block, pos, cache)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        walls, gpu = [], []
        for _ in range(10):
            t = time.perf_counter()
            start.record()
            model(block, pos, cache)
            end.record()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
            gpu.append(start.elapsed_time(end))
        print(f"{shape}: wall {sorted(walls)[5] * 1e3:.2f} ms per forward, GPU from first to last kernel "
              f"{sorted(gpu)[5]:.2f} ms (median of 10)")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(block, pos, cache)
            torch.cuda.synchronize()
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in ka if "Synchronize" in e.key or e.key in ("cudaMemcpyAsync",))
    print(f"kernel launches per forward: {launches}; host syncs/copies: {syncs}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b")
