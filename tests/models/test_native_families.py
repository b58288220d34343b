"""The native forward on every family's switches (q/k norms, sandwich and post norms, GeGLU, sliding
windows with their own RoPE base, partial rotary, NoPE layers, Granite's multipliers, Gemma 2's attention
soft-capping): close to the PyTorch reference, and the properties exact speculation rests on, bit for bit
(a block of K tokens scores like K one-token steps, tree branches like their chains, any number of threads)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from family_util import FAMILY_CONFIGS, WINDOW, family_config
from native_util import reference_and_native
from specdec.models import native
from specdec.models.llama import PromptChunk

pytestmark = pytest.mark.usefixtures("native_kernels")
NATIVE = list(FAMILY_CONFIGS)  # Gemma 2 too: attention soft-capping in attention.c, the final one in Python


def pair(name: str, quant: str | None = None):
    return reference_and_native(family_config(name), quant)


def test_what_the_native_forward_lacks_is_said():
    assert "gemma2" in NATIVE
    assert all(not native.missing_features(family_config(f)) for f in NATIVE)


def test_gemma2_attention_soft_capping_runs_natively():
    """A cap that squashes every score (0.5, where the suite's 20 leaves the tiny model's scores almost as
    they are): the native forward follows the reference, and the same forward without the cap does not;
    the final logits stay soft-capped (at 15)."""
    ref, nat = reference_and_native(dataclasses.replace(family_config("gemma2"), attn_softcap=0.5))
    assert nat.native is not None and nat.native.struct.attn_softcap == 0.5
    toks = torch.randint(0, 97, (2, 2 * WINDOW + 6), generator=torch.Generator().manual_seed(2))
    n = toks.shape[1]
    outs = []
    for m, cap in ((ref, None), (nat, 0.5), (nat, 0.0)):
        if cap is not None:
            m.native.struct.attn_softcap = cap
        cache = m.new_cache(2, 64)
        with torch.inference_mode():
            m(toks[:, :n - 6], torch.arange(n - 6).expand(2, -1), cache)
            outs.append(m(toks[:, n - 6:], torch.arange(n - 6, n).expand(2, -1), cache).logits.float())
    nat.native.struct.attn_softcap = 0.5
    a, b, uncapped = outs
    top = a.abs().max()
    assert (a - b).abs().max() < 0.03 * top
    assert (a - uncapped).abs().max() > 0.06 * top  # the cap matters here: the check above can fail
    assert b.abs().max() <= 15.0


def test_gemma2_prompt_chunks_riding_a_step_change_nothing():
    """Soft-capped attention over a prompt chunk riding a decode step: the step's logits, and what the
    chunk wrote to its row (read by that row's next token), as without the ride."""
    _, m = pair("gemma2")
    g = torch.Generator().manual_seed(5)
    seq, prompt = torch.randint(0, 97, (1, 24), generator=g), torch.randint(0, 97, (1, 26), generator=g)
    outs = []
    with torch.inference_mode():
        for ride in (False, True):
            cache = m.new_cache(2, 64)
            m(seq[:, :20], torch.arange(20)[None], cache, rows=torch.tensor([0]))
            m(prompt[:, :20], torch.arange(20)[None], cache, rows=torch.tensor([1]))
            if ride:
                step = m(seq[:, 20:], torch.arange(20, 24)[None], cache, rows=torch.tensor([0]),
                         prompt_chunks=[PromptChunk(1, prompt[0, 20:25].tolist(), 20)]).logits
            else:
                step = m(seq[:, 20:], torch.arange(20, 24)[None], cache, rows=torch.tensor([0])).logits
                m(prompt[:, 20:25], torch.arange(20, 25)[None], cache, rows=torch.tensor([1]), logits_positions="none")
            nxt = m(prompt[:, 25:], torch.tensor([[25]]), cache, rows=torch.tensor([1])).logits
            outs.append((step, nxt))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


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


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "olmo2", "mistral", "gemma2"])
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
