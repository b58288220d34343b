"""The native attention over the cache: close to the PyTorch path, and batch-invariant."""
import math

import pytest
import torch

from specdec.kernels.attention import cached_attention
from specdec.models.llama import attention, tree_attention

pytestmark = pytest.mark.usefixtures("native_kernels")  # skips without them; fails under SPECDEC_REQUIRE_KERNELS=1


def setup(B=2, nh=6, nkv=2, T=5, hd=32, max_len=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(3, nkv, max_len, hd, generator=g).bfloat16()
    vc = torch.randn(3, nkv, max_len, hd, generator=g).bfloat16()
    q = torch.randn(B, nh, T, hd, generator=g).bfloat16()
    rows = torch.tensor([2, 0])[:B]
    start = torch.tensor([40, 7])[:B]
    pos = start[:, None] + torch.arange(T)  # (B, T)
    return q, kc, vc, rows, pos


def paged(cache, table=None):
    """A static cache ``(rows, nkv, max_len, hd)`` as pool blocks of 32 slots in shuffled order, and
    its block table ``(rows, max_len / 32)``: the kernel must read every key through the table."""
    rows, nkv, max_len, hd = cache.shape
    nb = max_len // 32
    if table is None:
        table = 1 + torch.randperm(rows * nb, generator=torch.Generator().manual_seed(1)).view(rows, nb)
    pool = torch.zeros(1 + rows * nb, nkv, 32, hd, dtype=cache.dtype)
    pool[table.reshape(-1)] = cache.view(rows, nkv, nb, 32, hd).transpose(1, 2).reshape(rows * nb, nkv, 32, hd)
    return pool, table


def attend(q, kc, vc, rows, mask, scale):
    """The kernel over ``kc, vc`` paged."""
    (pk, table), (pv, _) = paged(kc), paged(vc)
    return cached_attention(q, pk, pv, table, rows, mask, scale)


def mask_for(pos, L):
    return (torch.arange(L)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # (B, 1, T, L)


HEAD_SIZES = [16, 32, 48, 128]  # 16 and 48: keys transposed in 32-wide pieces, the last one half full


@pytest.mark.parametrize("hd", HEAD_SIZES)
def test_matches_the_pytorch_path(hd):
    q, kc, vc, rows, pos = setup(hd=hd)
    L = 64
    m = mask_for(pos, L)
    got = attend(q, kc, vc, rows, m, 1 / math.sqrt(hd))
    want = attention(q, kc[rows, :, :L], vc[rows, :, :L], m)  # (B, nh, T, hd)
    want = want.transpose(1, 2).reshape(got.shape)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hd", HEAD_SIZES)
def test_a_query_gives_the_same_bits_in_any_call(hd):
    q, kc, vc, rows, pos = setup(hd=hd)
    full = attend(q, kc, vc, rows, mask_for(pos, 64), 0.2)  # (B, T, nh*hd)
    for b in range(2):
        for t in range(5):
            one = attend(q[b:b + 1, :, t:t + 1], kc, vc, rows[b:b + 1], mask_for(pos[b:b + 1, t:t + 1], 96), 0.2)
            assert torch.equal(one[0, 0], full[b, t]), (b, t)  # other L, other T, other B: same bits


def test_unsupported_shapes_fall_back():
    q, kc, vc, rows, pos = setup(hd=24)
    assert attend(q, kc, vc, rows, mask_for(pos, 64), 0.2) is None
    q, kc, vc, rows, pos = setup()
    assert attend(q.float(), kc, vc, rows, mask_for(pos, 64), 0.2) is None


def test_a_query_gives_the_same_bits_wherever_its_keys_sit():
    """A token-tree node whose ancestors sit among its siblings' slots attends exactly like its
    branch as a chain in consecutive slots (the kernel lists the visible keys first)."""
    q, kc, vc, rows, pos = setup(B=1, T=1)
    visible = [0, 1, 2, 5, 9, 10, 30, 31, 33, 40, 41]  # holes: a tree's siblings
    spread = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
    spread[..., visible] = True
    packed_k, packed_v = kc.clone(), vc.clone()
    packed_k[2, :, :len(visible)] = kc[2, :, visible]
    packed_v[2, :, :len(visible)] = vc[2, :, visible]
    chain = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
    chain[..., :len(visible)] = True
    got = attend(q, kc, vc, rows, spread, 0.2)
    want = attend(q, packed_k, packed_v, rows, chain, 0.2)
    assert torch.equal(got, want)
    # the PyTorch path does the same for a mask with holes (models.llama.tree_attention)
    got_t = tree_attention(q, kc[rows, :, :64], vc[rows, :, :64], spread)
    want_t = attention(q, packed_k[rows, :, :64], packed_v[rows, :, :64], chain)
    assert torch.equal(got_t, want_t)


@pytest.mark.parametrize("hd,nh", [(128, 6), (256, 4), (64, 2)])
def test_long_contexts_stream_with_the_same_bits(hd, nh):
    """Past 256 KB of a kv head's keys and values the kernel streams them (asks for them ahead as it goes,
    values in smaller chunks): close to the PyTorch path, and a query's bits the same whether its call
    streams (a long mask, a block of rows) or not (a short mask, alone)."""
    L, T = 1280, 4
    q, kc, vc, rows, _ = setup(B=1, nh=nh, nkv=2, T=T, hd=hd, max_len=L)
    pos = torch.tensor([[100, 301, 1100, 1279]])
    got = attend(q, kc, vc, rows, mask_for(pos, L), 1 / math.sqrt(hd))
    want = attention(q, kc[rows], vc[rows], mask_for(pos, L)).transpose(1, 2).reshape(got.shape)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    for t, p in enumerate(pos[0].tolist()):
        short = -(-(p + 1) // 32) * 32  # the keys it sees in whole blocks: 128 or 320, not streamed
        one = attend(q[:, :, t:t + 1], kc, vc, rows, mask_for(pos[:, t:t + 1], short), 1 / math.sqrt(hd))
        assert torch.equal(one[0, 0], got[0, t]), (hd, t)
