"""`specdec train medusa`: Medusa heads (``heads.medusa``) through the shared pipeline
(``train.pipeline``: the same data, held-out split, sharded extraction, resumable training and
acceptance evaluation as the EAGLE head), features being the target's final normed state only.

Loss: forward KL from the target's own distribution of the token head k predicts to head k's, at
every position: head k on the state at p predicts token p+1+k, whose target distribution is the LM
head on the final state at p+k (already in the features). Medusa-1 uses cross-entropy on the data's
tokens; the target's distribution (Medusa-2's self-distillation) is what verification accepts
against, carries more signal per position than one token, and makes any text (not only the
target's own outputs) teach the heads what the target would say. Heads are weighted ``0.8 ** k``
like the EAGLE unroll. Accuracy: head k's argmax equals the target's.

The loss runs over a training vocabulary (``--train-vocab-size``, the corpus's most frequent tokens,
as the EAGLE head's draft vocabulary): both laws are softmaxes over those rows of the LM head only,
the target's renormalised there. Its cost is a (positions x vocabulary) product, softmax and
gradient per head, so on Qwen2.5's 152k vocabulary 32k rows train ~4x faster. The heads then draft
over the same rows (``vocab`` in their weights: a drafting step reads a fifth of the LM head), and
``top_accuracies`` ranks them that way against the target's argmax over its whole vocabulary.

After training, ``top_accuracies`` measures on the held-out prompts' features how often the
target's token is each head's i-th choice; they go into the head's config.json and the candidate
tree is built from them (``proposers.medusa.sparse_tree``).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.heads.medusa import MedusaConfig, MedusaHeads, init_heads, save_heads
from specdec.train.pipeline import HeadKind, draft_vocab, run_pipeline
from specdec.train.train import TrainConfig, WindowLoss


def medusa_loss(heads: MedusaHeads, lm: torch.Tensor, cfg: TrainConfig) -> WindowLoss:
    """The window loss of ``heads`` over the LM head rows ``lm (V, C)``: all of them, or the training
    vocabulary's (see the module docstring)."""

    def loss_fn(shard: dict, span: tuple[int, int]) -> tuple[torch.Tensor, list[float], int]:
        a, b = span
        final = shard["final"][a:b].float()  # (T, C)
        T = final.shape[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = heads(final)  # (T, H, C)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            law = F.softmax((final[1:] @ lm.T).float(), dim=-1)  # (T-1, V): the target's law at 1..T-1, once
        want = law.argmax(-1)
        loss, accs = torch.zeros(()), []
        for k in range(1, heads.config.num_heads + 1):
            n = T - k  # head k at p reads final[p] and predicts token p+1+k: the target's law at p+k
            if n <= 0:
                break
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = out[:n, k - 1] @ lm.T  # (n, V)
            logq = F.log_softmax(logits.float(), dim=-1)
            loss = loss + 0.8 ** (k - 1) * -(law[k - 1:k - 1 + n] * logq).sum(-1).mean()
            accs.append(float((logits.argmax(-1) == want[k - 1:k - 1 + n]).float().mean()))
        return loss, accs, T - 1

    return loss_fn


@torch.inference_mode()
def top_accuracies(heads: MedusaHeads, lm: torch.Tensor, shards: list[Path], topk: int = 10) -> list[list[float]]:
    """``acc[k-1][i]``: the share of positions where the target's token at p+1+k (its argmax at p+k,
    over its full vocabulary) is head k's (i+1)-th most probable from p (over the rows it drafts
    from), over every sequence of ``shards``."""
    from safetensors.torch import load_file  # noqa: PLC0415

    H = heads.config.num_heads
    rows = (lm[heads.vocab] if heads.vocab is not None else lm).float()  # the rows the heads draft from
    hits = torch.zeros(H, topk, dtype=torch.float64)
    seen = torch.zeros(H, dtype=torch.float64)
    for path in shards:
        d = load_file(str(path))
        off = d["offsets"].tolist()
        for lo, hi in zip(off, off[1:]):
            final = d["final"][lo:hi].float()  # (T, C)
            want = (final @ lm.float().T).argmax(-1)  # (T,) the target's next token after each position
            out = heads(final)  # (T, H, C)
            for k in range(1, min(H, hi - lo - 1) + 1):
                n = hi - lo - k
                top = (out[:n, k - 1] @ rows.T).topk(topk, dim=-1).indices  # (n, topk)
                top = heads.vocab[top] if heads.vocab is not None else top  # as drafting ranks them
                hits[k - 1] += (top == want[k:k + n, None]).double().sum(0)
                seen[k - 1] += n
    return (hits / seen.clamp(min=1)[:, None]).tolist()


def medusa_kind(a: argparse.Namespace):
    def build(target, corpus, out: Path) -> HeadKind:
        c = target.config
        lm = target.weight(("model.embed_tokens.weight", "embed_tokens.weight")
                         if c.tie_word_embeddings else ("lm_head.weight",)).to(torch.bfloat16)  # (V, C)
        size = a.train_vocab_size if 0 < a.train_vocab_size < c.vocab_size else 0
        ids = draft_vocab(corpus, c.vocab_size, size, out) if size else None
        rows = lm[ids] if size else lm  # the loss's vocabulary
        mc = MedusaConfig(hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_heads=a.num_heads, target=a.model)
        heads = init_heads(MedusaHeads(mc), seed=a.seed)  # W = 0, b = 0: each head starts as the next-token head
        heads.set_vocab(ids)  # and drafts over the same rows

        def measure(held: list[Path]) -> dict:
            acc = top_accuracies(heads, lm, held, a.topk)
            heads.config = dataclasses.replace(heads.config, top_accuracies=[[round(x, 5) for x in r] for r in acc])
            return {"top_accuracies": heads.config.top_accuracies}

        return HeadKind("medusa", (), heads, lambda tc: medusa_loss(heads, rows, tc), lambda d: save_heads(d, heads),
                        a.num_heads, eval_k=a.eval_nodes, after_training=measure)
    return build


def run(a: argparse.Namespace) -> int:
    return run_pipeline(a, medusa_kind(a))
