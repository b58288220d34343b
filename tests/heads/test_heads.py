"""The EAGLE-3 head: drafting through its KV cache computes exactly what training-time test trains."""
from __future__ import annotations

import torch

from specdec.heads.eagle import EagleConfig, EagleHead, init_head


def tiny_head(seed: int = 0) -> EagleHead:
    c = EagleConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=50, draft_vocab_size=20, aux_layer_ids=(1, 2, 3), target_hidden_size=32)
    return init_head(EagleHead(c), seed=seed).eval()


def test_cached_drafting_matches_training_time_test():
    torch.manual_seed(0)
    head = tiny_head()
    T, steps = 7, 3
    embeds, feats = torch.randn(1, T, 32), torch.randn(1, T, 96)
    with torch.no_grad():
        unrolled = head.unrolled(embeds, feats, steps)  # each (1, T, C)
        for p in range(T - steps):
            cache = head.new_cache(1, 64)
            rows = torch.tensor([0])
            pos = torch.arange(p + 1)[None]
            out = head.step(embeds[:, :p + 1], head.fc(feats[:, :p + 1]), pos, pos, cache, rows)
            torch.testing.assert_close(out, unrolled[0][:, :p + 1], rtol=1e-5, atol=1e-5)
            h = out[:, -1:]
            for k in range(1, steps):  # draft step k at position p + k reads the true token x_{p+k+1}
                at = torch.tensor([[p + k]])
                h = head.step(embeds[:, p + k:p + k + 1], h, at, at, cache, rows)
                torch.testing.assert_close(h[:, 0], unrolled[k][:, p], rtol=1e-5, atol=1e-5)


def test_draft_vocabulary_maps_back_to_target_ids():
    head = tiny_head()
    ids = torch.tensor([3, 7, 11, 0, 49] + list(range(20, 35)))
    head.set_vocab(ids)
    assert head.target_ids().tolist() == ids.tolist()
    assert head.t2d.sum() == 20 and head.t2d[49] and not head.t2d[1]
    full = head.to_target_vocab(torch.arange(20.0)[None])  # (1, 50)
    assert full[0, 49] == 4 and full[0, 7] == 1 and torch.isinf(full[0, 1])


def test_training_step_reduces_loss():
    torch.manual_seed(0)
    head = tiny_head().train()
    embeds, feats = torch.randn(2, 8, 32), torch.randn(2, 8, 96)
    target = torch.randint(0, 20, (2, 8))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        outs = head.unrolled(embeds, feats, 2)
        loss = sum(torch.nn.functional.cross_entropy(head.logits(o).flatten(0, 1), target.flatten()) for o in outs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
