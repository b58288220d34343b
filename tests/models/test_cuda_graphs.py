"""The CUDA-graph replay of decode and verification forwards (models/cuda_graphs.py).

On the CPU the bookkeeping is checked with a capture that reruns the function into the same output
tensors (what a replay does): inputs copied in, outputs copied out, one capture per shape, the cache's
growth, the bound on graphs, errors before any capture. On a GPU (skipped here) the real graphs: a replay
bit-identical to the eager forward reading as many keys, across steps, blocks and a token tree."""
from __future__ import annotations

import pytest
import torch

from specdec.config import ModelConfig
from specdec.models import cuda_graphs
from specdec.models.cuda_graphs import CudaGraphs, kv_bucket
from specdec.models.llama import build_model


def config() -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="qwen2",
                       attention_bias=True)


def rerun(run, pool):
    """A stand-in for a CUDA capture: the replay reruns ``run`` and writes into the first run's outputs."""
    logits, hidden = run()

    def replay() -> None:
        new_logits, new_hidden = run()
        if logits is not None:
            logits.copy_(new_logits)
        for k, v in new_hidden.items():
            hidden[k].copy_(v)

    return replay, (logits, hidden), pool


def pair(device: str = "cpu"):
    """The same random model twice: one eager, one replaying its forwards."""
    eager, graphed = (build_model(config(), dtype=torch.bfloat16, device=device, seed=5) for _ in range(2))
    graphed.graphs = CudaGraphs(capture=rerun) if device == "cpu" else CudaGraphs()
    return eager, graphed


def prefill(model, cache, tokens: torch.Tensor) -> None:
    B, T = tokens.shape
    model(tokens, torch.arange(T, device=tokens.device).expand(B, T), cache, fused_attention=False)


def test_kv_bucket():
    assert kv_bucket(32, 4096) == 256
    assert kv_bucket(256, 4096) == 256
    assert kv_bucket(288, 4096) == 512
    assert kv_bucket(288, 320) == 320  # never past the cache
    assert kv_bucket(4096, 4096) == 4096


def test_decoding_replays_one_graph_and_matches_the_eager_forward_bit_for_bit():
    eager, graphed = pair()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (2, 9), generator=g)
    with torch.inference_mode():
        ce, cg = eager.new_cache(2, 400), graphed.new_cache(2, 400)
        prefill(eager, ce, prompt)
        prefill(graphed, cg, prompt)  # inference mode: this prefill is a graph too (B=2, T=9)
        tok = prompt[:, -1:]
        kept = []
        for step in range(12):
            pos = torch.full((2, 1), 9 + step)
            a = eager(tok, pos, ce, hidden_layers=(-1, 1))
            b = graphed(tok, pos, cg, hidden_layers=(-1, 1))
            assert torch.equal(a.logits, b.logits) and a.hidden.keys() == b.hidden.keys()
            assert all(torch.equal(a.hidden[k], b.hidden[k]) for k in a.hidden)
            kept.append(b.logits)
            tok = a.logits[:, -1].argmax(-1, keepdim=True)
        assert all(not torch.equal(kept[0], x) for x in kept[1:])  # each step's logits its own copy
        assert graphed.graphs.captures == 2 and graphed.graphs.replays == 13  # the prefill's shape, then one decode shape
        # the same for the rows a caller names, a verification block and chosen logits positions
        rows, block = torch.tensor([1, 0]), torch.randint(0, 97, (2, 4), generator=g)
        pos = torch.arange(21, 25).expand(2, 4)
        at = torch.tensor([[0, 3], [2, 3]])
        a = eager(block, pos, ce, rows=rows, logits_positions=at)
        b = graphed(block, pos, cg, rows=rows, logits_positions=at)
        assert torch.equal(a.logits, b.logits)


def test_tree_masks_and_skipped_layers_are_their_own_shapes():
    eager, graphed = pair()
    prompt = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    with torch.inference_mode():
        ce, cg = eager.new_cache(1, 64), graphed.new_cache(1, 64)
        prefill(eager, ce, prompt)
        prefill(graphed, cg, prompt)
        toks, pos = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[12, 13, 13, 14]])
        slots = torch.arange(12, 16).view(1, 4)
        for skip in (frozenset(), frozenset({1})):
            a = eager(toks, pos, ce, cache_pos=slots, attn_mask=tree, skip_layers=skip)
            b = graphed(toks, pos, cg, cache_pos=slots, attn_mask=tree, skip_layers=skip)
            assert torch.equal(a.logits, b.logits)
        assert graphed.graphs.captures == 3
        with pytest.raises(ValueError, match="before slot 0"):  # refused before anything is captured
            graphed(toks, pos, cg, cache_pos=torch.arange(0, 4).view(1, 4), attn_mask=torch.ones(1, 4, 8, dtype=torch.bool))
        with pytest.raises(ValueError, match="past the KV cache"):
            graphed(toks[:, :1], torch.tensor([[64]]), cg)
        assert graphed.graphs.captures == 3


def test_a_grown_cache_gets_new_graphs_and_the_number_of_graphs_is_bounded():
    eager, graphed = pair()
    graphed.graphs.max_graphs = 2
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ce, cg = eager.new_cache(1, 64), graphed.new_cache(1, 64)
        prefill(eager, ce, prompt)
        prefill(graphed, cg, prompt)
        for t in (1, 2, 3):  # three shapes: the oldest graph goes
            toks, pos = prompt[:, :t], torch.arange(6, 6 + t).view(1, t)
            assert torch.equal(eager(toks, pos, ce).logits, graphed(toks, pos, cg).logits)
        assert len(graphed.graphs.by_cache[id(cg)].graphs) == 2
        ce.grow(1, 128)
        cg.grow(1, 128)  # new storage: graphs captured against the old one must not replay
        before = graphed.graphs.captures
        toks, pos = prompt[:, :1], torch.tensor([[9]])
        assert torch.equal(eager(toks, pos, ce).logits, graphed(toks, pos, cg).logits)
        assert graphed.graphs.captures == before + 1
        other = graphed.new_cache(1, 64)  # a second cache: graphs of its own
        prefill(graphed, other, prompt)
        assert len(graphed.graphs.by_cache) == 2


def test_graphs_only_where_asked_and_in_inference_mode(monkeypatch):
    model = build_model(config(), dtype=torch.bfloat16)
    assert not model.use_cuda_graphs(True) and model.graphs is None  # a CPU model: no graphs
    _, graphed = pair()
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # outside inference mode (a caller may change the outputs in place): eager
        graphed(prompt, torch.arange(5).view(1, 5), graphed.new_cache(1, 32))
    assert graphed.graphs.captures == 0
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "0")
    assert not cuda_graphs.enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_replays_are_the_eager_forward_bit_for_bit():
    eager, graphed = pair("cuda")
    dev = "cuda"
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        ce, cg = eager.new_cache(2, 600), graphed.new_cache(2, 600)
        prompt = torch.randint(0, 97, (2, 200), generator=g).to(dev)
        ppos = torch.arange(200, device=dev).expand(2, 200)
        eager.layers_forward(prompt, ppos, ce, kv_len=kv_bucket(eager.prepare(ce, None, ppos, None), ce.max_len))
        graphed(prompt, ppos, cg)  # a graph too: the same keys read, so the same cache
        tok = prompt[:, -1:]
        for step in range(80):  # crosses the 256-key bucket
            pos = torch.full((2, 1), 200 + step, device=dev)
            b = graphed(tok, pos, cg)
            kv = kv_bucket(eager.prepare(ce, None, pos, None), ce.max_len)  # the keys the graph read
            a = eager.layers_forward(tok, pos, ce, kv_len=kv)
            assert torch.equal(a.logits, b.logits), step
            tok = a.logits[:, -1].argmax(-1, keepdim=True)
        block = torch.randint(0, 97, (2, 5), generator=g).to(dev)
        pos = torch.arange(280, 285, device=dev).expand(2, 5)
        b = graphed(block, pos, cg)
        a = eager.layers_forward(block, pos, ce, kv_len=kv_bucket(eager.prepare(ce, None, pos, None), ce.max_len))
        assert torch.equal(a.logits, b.logits)
        assert graphed.graphs.captures <= 4
