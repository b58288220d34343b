"""Training a drafter head (EAGLE-3's here; Medusa's in ``train.medusa``) on extracted features, on
the CPU, resumable at any point: ``train`` is the loop, a head kind brings its window loss.

EAGLE-3 loss: forward KL from the target's distribution (its LM head on its final hidden state, restricted
to the draft vocabulary and renormalized, as EAGLE-3 does) to the head's, at every step of a
training-time-test unroll (``EagleHead.unrolled``), step k weighted ``0.8 ** k`` (HASS / EAGLE-3).
Top-1 accuracy: the head's argmax equals the target's.

The data order is a pure function of (seed, epoch): shards shuffled, then the windows of each shard,
so a checkpoint only needs a cursor. ``checkpoint.pt`` (head, optimizer, cursor, history) is written
every ``checkpoint_minutes`` to a temporary name and renamed: killing the process at any moment
loses at most the work since the last checkpoint, and a rerun of the same command resumes.
"""
from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.heads.eagle import EagleHead

# (shard tensors, (start, end) token span) -> (loss, one accuracy per metric, positions counted)
WindowLoss = Callable[[dict, tuple[int, int]], tuple[torch.Tensor, list[float], int]]

CHECKPOINT = "checkpoint.pt"


@dataclass
class TrainConfig:
    epochs: float = 1.0
    seq_len: int = 512  # window length
    batch_tokens: int = 2048  # tokens per optimizer step (gradient accumulation over windows)
    lr: float = 3e-4
    warmup_steps: int = 50
    ttt_steps: int = 3
    step_decay: float = 0.8
    weight_decay: float = 0.0
    checkpoint_minutes: float = 5.0
    seed: int = 0


@dataclass
class Cursor:
    epoch: int = 0
    shard: int = 0  # index into the epoch's shard order
    window: int = 0  # index into the shard's window order
    step: int = 0  # optimizer steps done
    tokens: int = 0  # training positions seen
    seconds: float = 0.0  # training wall time so far (over resumes)


def shard_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1000003 + epoch).shuffle(order)
    return order


def windows(offsets: torch.Tensor, seq_len: int, seed: int, epoch: int, shard: int) -> list[tuple[int, int]]:
    """(start, end) token ranges of a shard, each inside one sequence, shuffled by (seed, epoch, shard)."""
    out = []
    for s in range(len(offsets) - 1):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        for a in range(lo, hi - 2, seq_len):
            out.append((a, min(hi, a + seq_len + 1)))  # +1: the window's last token is a target only
    random.Random((seed * 1000003 + epoch) * 7919 + shard).shuffle(out)
    return out


def window_loss(head: EagleHead, embed: torch.Tensor, lm_rows: torch.Tensor, shard: dict, span: tuple[int, int],
                cfg: TrainConfig) -> tuple[torch.Tensor, list[float], int]:
    """Loss of one window, top-1 accuracy per TTT step, and the positions counted.

    Index p reads the target's features at p and the embedding of token p+1; step k predicts
    token p+k+2, whose target distribution is the LM head on the final state at p+k+1.
    """
    a, b = span
    toks = shard["tokens"][a:b].long()  # (T+1,)
    feats = shard["feats"][a:b - 1].float()[None]  # (1, T, 3C)
    final = shard["final"][a + 1:b].float()  # (T, C): final state at p+1
    T = feats.shape[1]
    embeds = embed[toks[1:]].float()[None]  # (1, T, C)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        target = F.softmax((final @ lm_rows.T).float(), dim=-1)  # (T, Vd)
    steps = min(cfg.ttt_steps, T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = head.unrolled(embeds, feats, steps)
    loss = torch.zeros(())
    accs = []
    for k, h in enumerate(outs):
        n = T - k  # valid indices p < T - k (target at p + k)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.logits(h[0, :n])
        logq = F.log_softmax(logits.float(), dim=-1)  # (n, Vd)
        p = target[k:k + n]
        loss = loss + (cfg.step_decay ** k) * -(p * logq).sum(-1).mean()
        accs.append(float((logits.argmax(-1) == p.argmax(-1)).float().mean()))
    return loss, accs, T


def eagle_loss(head: EagleHead, embed: torch.Tensor, lm_rows: torch.Tensor, cfg: TrainConfig) -> WindowLoss:
    """``window_loss`` of ``head``: ``embed (V, C)`` the target's embedding table, ``lm_rows (Vd, C)``
    its LM head rows of the draft vocabulary."""
    return lambda shard, span: window_loss(head, embed, lm_rows, shard, span, cfg)


def train(head: nn.Module, loss_fn: WindowLoss, shards: list[Path], epoch_tokens: int, out: Path, cfg: TrainConfig,
          on_checkpoint: Callable[[Cursor, dict], dict] | None = None, progress: bool = True,
          metrics: int | None = None) -> tuple[Cursor, list[dict]]:
    """Train ``head`` (fp32 weights, bf16 autocast) over ``shards``; resumes from ``out/checkpoint.pt``.
    Returns the cursor and the checkpoints' history (each entry with its evaluation).

    ``loss_fn(shard, span)``: one window's loss and ``metrics`` accuracies (default ``cfg.ttt_steps``);
    ``epoch_tokens``: the shards' tokens (for the schedule and the progress bar).
    ``on_checkpoint(cursor, metrics)`` runs after each checkpoint (export the head, measure
    acceptance) and returns what to add to the history.
    """
    from safetensors.torch import load_file  # noqa: PLC0415
    from specdec.formats.progress import bar as progress_bar  # noqa: PLC0415

    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    cur, history = Cursor(), []
    ckpt = out / CHECKPOINT
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        cur, history = Cursor(**state["cursor"]), state["history"]
    total = max(1, int(epoch_tokens * cfg.epochs))
    total_steps = max(1, total // cfg.batch_tokens)
    bar = progress_bar(total=total, initial=min(cur.tokens, total), unit="tok", desc="train", disable=not progress,
               smoothing=0.05)
    t_ckpt, t_start, t_base = time.monotonic(), time.monotonic(), cur.seconds
    n_acc = metrics or cfg.ttt_steps
    run_loss, run_acc, acc_tokens = 0.0, [0.0] * n_acc, 0
    done = cur.tokens >= total  # a rerun of a finished training changes nothing
    while not done:
        order = shard_order(len(shards), cfg.seed, cur.epoch)
        while cur.shard < len(order) and not done:
            data = load_file(str(shards[order[cur.shard]]))
            spans = windows(data["offsets"], cfg.seq_len, cfg.seed, cur.epoch, order[cur.shard])
            while cur.window < len(spans):
                loss, accs, n = loss_fn(data, spans[cur.window])
                (loss * n / cfg.batch_tokens).backward()
                cur.window += 1
                cur.tokens += n
                acc_tokens += n
                run_loss += float(loss.detach()) * n
                run_acc = [r + a * n for r, a in zip(run_acc, accs + [0.0] * (n_acc - len(accs)))]
                bar.update(n)
                if acc_tokens >= cfg.batch_tokens:
                    lr = cfg.lr * min(1.0, (cur.step + 1) / cfg.warmup_steps) * \
                        0.5 * (1 + math.cos(math.pi * min(1.0, cur.step / total_steps)))
                    for g in opt.param_groups:
                        g["lr"] = lr
                    torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    cur.step += 1
                    bar.set_postfix(loss=f"{run_loss / acc_tokens:.3f}",
                                    acc="/".join(f"{r / acc_tokens:.2f}" for r in run_acc), step=cur.step)
                    metrics = {"loss": run_loss / acc_tokens, "top1": [r / acc_tokens for r in run_acc]}
                    run_loss, run_acc, acc_tokens = 0.0, [0.0] * n_acc, 0
                    last = cur.tokens >= total
                    if last or time.monotonic() - t_ckpt >= cfg.checkpoint_minutes * 60:
                        cur.seconds = t_base + time.monotonic() - t_start
                        history.append(save_checkpoint(ckpt, head, opt, cur, history, cfg, metrics, on_checkpoint))
                        t_ckpt = time.monotonic()
                    if last:
                        done = True
                        break
            if not done:
                cur.shard, cur.window = cur.shard + 1, 0
        if not done:
            cur.epoch, cur.shard, cur.window = cur.epoch + 1, 0, 0
    bar.close()
    return cur, history


def save_checkpoint(path: Path, head: nn.Module, opt, cur: Cursor, history: list, cfg: TrainConfig, metrics: dict,
                    on_checkpoint: Callable[[Cursor, dict], dict] | None) -> dict:
    """Write the training state atomically; then the caller's export / evaluation."""
    entry = {"step": cur.step, "tokens": cur.tokens, "seconds": round(cur.seconds, 1), **metrics}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "cursor": asdict(cur),
                "history": history + [entry], "config": asdict(cfg)}, tmp)
    os.replace(tmp, path)
    if on_checkpoint is not None:
        head.eval()
        entry.update(on_checkpoint(cur, entry))
        head.train()
        state = torch.load(path, weights_only=False)  # keep the evaluation in the saved history too
        state["history"][-1] = entry
        torch.save(state, tmp)
        os.replace(tmp, path)
    return entry
