"""The decode and verification forwards of a GPU, replayed as CUDA graphs.

On a GPU the eager PyTorch path is bound by the host: a forward of the 1.5B shape issues ~1,400 kernels
and spends ~35 ms launching them for ~3.4 ms of GPU work (BENCHMARKS.md, "On a GPU"), whatever the
model's size, so a draft model's forward costs what the target's does. Here each forward shape is
captured once as a CUDA graph (gpt-fast's and vLLM's remedy) and replayed with one launch:

- the host's part stays outside (``Transformer.prepare``: the position checks and the mapping of the
  KV blocks written, which read tensors on the host);
- the rest (``Transformer.layers_forward`` with a fixed number of keys) is captured per shape: rows B,
  tokens T, keys read (``kv_bucket``: powers of two from 256, so a sequence crosses a handful of them),
  the tree mask's width, which logits and hidden states are returned, the layers skipped;
- inputs are copied into the graph's own tensors before a replay, outputs copied out after it (a caller
  may keep them across forwards: a drafter keeps each draft token's logits).

Exactness: a replay runs the very kernels an eager forward of that shape runs, so a graph's output is
bit-identical to ``layers_forward`` with the same number of keys (tests/models/test_cuda_graphs.py on a
GPU), and everything batch-invariant on the eager path stays so. Graphs belong to one KV cache's storage:
a cache that grows (new tensors) or a new cache gets its own, the older ones are dropped.

``SPECDEC_CUDA_GRAPHS=0`` turns them off (the eager path, for comparisons).
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from specdec.runtime.kv_cache import KVCache

MAX_GRAPHS = 64  # per cache: rows x tokens x key buckets x heads; the oldest unused one goes first
MIN_BUCKET = 256


def enabled() -> bool:
    return os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0"


def kv_bucket(kv_len: int, max_len: int) -> int:
    """Keys a captured forward reads for ``kv_len`` needed: the next power of two from MIN_BUCKET, at
    most the cache's length (a multiple of KV_BLOCK, as the eager path's)."""
    b = MIN_BUCKET
    while b < kv_len:
        b *= 2
    return min(b, max_len)


@dataclass
class _Graph:
    """One captured shape: its input tensors, the replay, and the outputs it writes."""

    inputs: dict[str, torch.Tensor]
    replay: Callable[[], None]
    logits: torch.Tensor | None
    hidden: dict[int, torch.Tensor]


@dataclass
class _CacheGraphs:
    """The graphs captured against one KV cache's storage (kept alive, so its addresses stay valid), and
    the memory pool they share: theirs alone, so it lives exactly as long as they do (PyTorch frees a pool
    with its last graph, and a capture given that pool's handle afterwards fails an internal assert)."""

    cache: weakref.ref
    storage: tuple[torch.Tensor, ...]
    graphs: OrderedDict = field(default_factory=OrderedDict)
    pool: object = None

    def valid_for(self, cache: KVCache) -> bool:
        return self.cache() is cache and all(a is b for a, b in zip(self.storage, cache.tensors()))


def _capture_cuda(run: Callable[[], tuple], pool: object) -> tuple[Callable[[], None], tuple, object]:
    """Capture ``run`` as a CUDA graph after two warm-up runs on a side stream (cuBLAS sets up its
    workspaces there, not inside the capture): (replay, the outputs it writes, the memory pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph.replay, out, graph.pool()


class CudaGraphs:
    """A Transformer's captured forwards (``Transformer.use_cuda_graphs``); called as ``forward``.

    ``capture`` is how a function becomes a replay: a CUDA graph (the default); the tests of the
    bookkeeping on a CPU pass one that reruns the function on the same tensors."""

    def __init__(self, capture: Callable = _capture_cuda, max_graphs: int = MAX_GRAPHS) -> None:
        self.capture, self.max_graphs = capture, max_graphs
        self.by_cache: dict[int, _CacheGraphs] = {}
        self.captures = self.replays = 0

    def _graphs_of(self, cache: KVCache) -> _CacheGraphs:
        entry = self.by_cache.get(id(cache))
        if entry is None or not entry.valid_for(cache):
            for key in [k for k, e in self.by_cache.items() if e.cache() is None]:  # caches gone: their graphs too
                del self.by_cache[key]
            entry = self.by_cache[id(cache)] = _CacheGraphs(weakref.ref(cache), cache.tensors())
        return entry

    def __call__(self, model: nn.Module, tokens: torch.Tensor, input_pos: torch.Tensor, cache: KVCache, *,
                 rows: torch.Tensor | None, cache_pos: torch.Tensor | None, attn_mask: torch.Tensor | None,
                 skip_layers: frozenset[int], hidden_layers: tuple[int, ...],
                 logits_positions: str | torch.Tensor) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """``model``'s forward (a ``Transformer``: its ``prepare`` and ``layers_forward``) replayed:
        the logits and hidden states of ``ForwardOutput``, copies of the graph's."""
        B, T = tokens.shape
        cache_pos = input_pos if cache_pos is None else cache_pos
        kv_len = kv_bucket(model.prepare(cache, rows, cache_pos, attn_mask), cache.max_len)
        dev = tokens.device
        given = {"tokens": tokens, "input_pos": input_pos, "cache_pos": cache_pos,
                 "rows": torch.arange(B, device=dev) if rows is None else rows}
        if attn_mask is not None:
            given["attn_mask"] = attn_mask
        lp = logits_positions
        if isinstance(lp, torch.Tensor):
            given["logits_positions"] = lp
        key = (B, T, kv_len, None if attn_mask is None else attn_mask.shape[-1],
               lp if isinstance(lp, str) else tuple(lp.shape), frozenset(skip_layers), tuple(hidden_layers))
        entry = self._graphs_of(cache)
        graphs = entry.graphs
        g = graphs.get(key)
        if g is None:
            inputs = {k: v.to(dev).clone() for k, v in given.items()}

            def run() -> tuple:
                out = model.layers_forward(
                    inputs["tokens"], inputs["input_pos"], cache, rows=inputs["rows"], cache_pos=inputs["cache_pos"],
                    attn_mask=inputs.get("attn_mask"), skip_layers=skip_layers, hidden_layers=hidden_layers,
                    logits_positions=inputs.get("logits_positions", lp), kv_len=kv_len)
                return out.logits, out.hidden

            replay, (logits, hidden), entry.pool = self.capture(run, entry.pool)
            g = graphs[key] = _Graph(inputs, replay, logits, hidden)
            self.captures += 1
            while len(graphs) > self.max_graphs:
                graphs.popitem(last=False)
        else:
            graphs.move_to_end(key)
            for k, v in given.items():
                g.inputs[k].copy_(v, non_blocking=True)
        g.replay()
        self.replays += 1
        return None if g.logits is None else g.logits.clone(), {k: v.clone() for k, v in g.hidden.items()}
