"""A sequence's cache memory against its context: a hybrid's recurrent states and a windowed model's windowed
keys stay put, the global layers' KV blocks grow.

    python -m specdec.tools.bench.cache_memory --shape qwen3.5-0.8b --layers 4 --contexts 1024,8192,32768
    python -m specdec.tools.bench.cache_memory --shape gemma-3-4b --layers 6 --quantization int4

Builds a random-weight model of the shape (its first ``--layers`` layers: with Qwen3.5's pattern, three
delta-net layers and one attention layer; with Gemma 3's, five windowed layers and one global one),
prefills one sequence to each context in chunks of 512 tokens and prints, per context: the bytes of the
row's state rings (what the cache allocated for them), the bytes of the KV blocks the row maps for the
layers without a window, the bytes of the windowed layers' blocks it still maps (and what they would be if
every one were kept), and the process's resident memory.
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

from specdec.runtime.kv_cache import KV_BLOCK
from specdec.tools.bench.step import SHAPES, random_model


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-0.8b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quantization", choices=["int4", "int8"], default=None)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--chunk", type=int, default=512)
    a = ap.parse_args(argv)
    model = random_model(a.shape, a.layers, a.quantization, native=True)
    cfg = model.config
    kinds = list(cfg.layer_mixers or (f"window {cfg.window(i)}" if cfg.window(i) else "global"
                                      for i in range(cfg.num_hidden_layers)))
    print(f"{a.shape}, first {a.layers} layers {kinds}; path: "
          f"{'native' if model.native is not None else 'PyTorch'}; state ring entries per row: {model.state_slots}")
    print("| context | state rings MB | KV blocks MB (no window) | windowed blocks MB held | windowed if all kept MB "
          "| resident MB | prefill s |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(c) for c in a.contexts.split(",")):
        cache = model.new_cache(1, n + KV_BLOCK)
        toks = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        with torch.inference_mode():
            for lo in range(0, n, a.chunk):
                hi = min(n, lo + a.chunk)
                model(toks[:, lo:hi], torch.arange(lo, hi).view(1, -1), cache, logits_positions="none")
        secs = time.perf_counter() - t0
        rings = sum(x.nbytes for x in getattr(cache, "inputs", ())) + sum(
            s.nbytes for s in getattr(cache, "states", ()) if s is not None)
        kv = len(cache.blocks[0]) * cache.block_bytes()
        held = all_kept = 0
        if cache.local is not None:
            held = sum(1 for b in cache.local.blocks[0] if b) * cache.local.block_bytes()
            all_kept = len(cache.local.blocks[0]) * cache.local.block_bytes()
        print(f"| {n} | {rings / 1e6:.2f} | {kv / 1e6:.2f} | {held / 1e6:.2f} | {all_kept / 1e6:.2f} | {rss_mb():.0f} "
              f"| {secs:.1f} |")
        del cache
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
