"""Where one CUDA forward's time goes (scripts/cuda_checks.sh runs it on a lent GPU): a random-weight
model of a real shape on the engine's PyTorch path, one token after a 256-token context; wall time,
the GPU's busy time (CUDA events) and the operators that take the host's time, from PyTorch's profiler.

    python -m specdec.tools.bench.cuda_profile [SHAPE] [LAYERS]    # default qwen2.5-1.5b, 28 layers
"""
from __future__ import annotations

import argparse
import time

import torch

from specdec.tools.bench.step import random_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?", default="qwen2.5-1.5b", help="a shape of the step tool")
    ap.add_argument("layers", nargs="?", type=int, default=28, help="its first LAYERS decoder layers")
    a = ap.parse_args(argv)
    shape = a.shape
    model = random_model(shape, a.layers, None, False, "cuda")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
