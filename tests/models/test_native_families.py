"""The native forward on every family's switches (q/k norms, sandwich and post norms, GeGLU, sliding
windows with their own RoPE base, partial rotary, NoPE layers, Granite's multipliers): close to the
PyTorch reference, and the properties exact speculation rests on, bit for bit (a block of K tokens
scores like K one-token steps, tree branches like their chains, any number of threads)."""
from __future__ import annotations

import pytest
import torch

from family_util import FAMILY_CONFIGS, WINDOW, family_config
from native_util import reference_and_native
from specdec.models import native

pytestmark = pytest.mark.usefixtures("native_kernels")
NATIVE = [f for f in FAMILY_CONFIGS if f != "gemma2"]  # Gemma 2's attention soft-capping: the PyTorch path


def pair(name: str, quant: str | None = None):
    return reference_and_native(family_config(name), quant)


def test_what_the_native_forward_lacks_is_said():
    cfg = family_config("gemma2")
    assert native.missing_features(cfg) == ["attention soft-capping"]
    assert all(not native.missing_features(family_config(f)) for f in NATIVE)


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("quant", [None, "int4"])
def test_native_logits_agree_with_the_reference(name, quant):
    ref, nat = pair(name, quant)
    toks = torch.randint(0, 97, (2, 2 * WINDOW + 6), generator=torch.Generator().manual_seed(1))
    n = toks.shape[1]
    outs = []
    for m in (ref, nat):
        cache = m.new_cache(2, 64)
        with torch.inference_mode():
            m(toks[:, :n - 6], torch.arange(n - 6).expand(2, -1), cache, fused_attention=True)
            outs.append(m(toks[:, n - 6:], torch.arange(n - 6, n).expand(2, -1), cache).logits.float())
    a, b = outs
    # bf16 sums in another order (and int4 activations quantized on either side): close, not equal
    assert (a - b).abs().max() < (0.03 if quant is None else 0.05) * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("name", NATIVE)
def test_blocks_of_any_size_score_exactly_like_one_token_steps(name):
    _, m = pair(name)
    seqs = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        step_cache = m.new_cache(2, 96)
        m(seqs[:, :24], torch.arange(24).expand(2, 24), step_cache)
        steps = torch.stack([m(seqs[r:r + 1, t:t + 1], torch.tensor([[t]]), step_cache, rows=torch.tensor([r])).logits[0, 0]
                             for r in range(2) for t in range(24, 64)]).view(2, 40, -1)
        block_cache = m.new_cache(2, 96)
        m(seqs[:, :24], torch.arange(24).expand(2, 24), block_cache)
        t = 24
        for k in (1, 2, 5, 9, 7, 16):
            out = m(seqs[:, t:t + k], torch.arange(t, t + k).expand(2, k), block_cache).logits
            assert torch.equal(out, steps[:, t - 24:t - 24 + k]), (k, t)
            t += k


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "olmo2", "mistral"])
def test_tree_branches_score_exactly_like_their_chains(name):
    """Past the window (the prefix is 37 tokens, the window 16): a tree's branches still read exactly
    the keys, and the bits, of their chains."""
    _, m = pair(name)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 97, (37,), generator=g)
    a, b = torch.randint(0, 97, (3,), generator=g), torch.randint(0, 97, (2,), generator=g)
    with torch.inference_mode():
        chains = []
        for branch in (a, b):
            c = m.new_cache(1, 64)
            m(prefix[None], torch.arange(37)[None], c)
            chains.append(m(branch[None], torch.arange(37, 37 + len(branch))[None], c).logits[0])
        cache = m.new_cache(1, 64)
        m(prefix[None], torch.arange(37)[None], cache)
        tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
                            dtype=torch.bool)[None]
        out = m(torch.cat([a, b])[None], torch.tensor([[37, 38, 39, 37, 38]]), cache,
                cache_pos=torch.arange(37, 42)[None], attn_mask=tree).logits[0]
    assert torch.equal(out[:3], chains[0])
    assert torch.equal(out[3:], chains[1])


@pytest.mark.parametrize("name", ["gemma3", "olmo2"])
def test_results_do_not_depend_on_the_number_of_threads(name):
    _, m = pair(name)
    toks = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(7))
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, threads, threads + 1):
            torch.set_num_threads(n)
            cache = m.new_cache(2, 64)
            with torch.inference_mode():
                m(toks[:, :30], torch.arange(30).expand(2, 30), cache)
                outs.append(m(toks[:, 30:], torch.arange(30, 40).expand(2, 10), cache).logits)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
