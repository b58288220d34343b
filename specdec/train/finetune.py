"""Fine-tuning a draft model on the target's outputs (``specdec distill``), on the CPU, resumable.

The draft is loaded with Hugging Face ``transformers`` (its directory is a standard one) and trained
either whole (``full``: fp32 master weights, bf16 autocast) or through LoRA adapters on every linear
layer of its blocks (``lora``, with ``peft``: the maintained implementation, merged into the weights
at the end so the result is a plain model directory). Loss: cross-entropy on the target's tokens
only (the prompt is context), summed per optimizer step of ``batch_tokens`` target tokens. Top-1
accuracy: the draft's argmax equals the target's token (what greedy acceptance counts).

The data order is a pure function of (seed, epoch), so ``checkpoint.pt`` (trainable weights,
optimizer, cursor, history) written every ``checkpoint_minutes`` to a temporary name and renamed is
all a rerun needs: killing the process loses at most the work since the last checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError

CHECKPOINT = "checkpoint.pt"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt")


@dataclass
class FinetuneConfig:
    mode: str = "lora"  # "lora" | "full"
    epochs: float = 2.0
    lr: float | None = None  # default: 2e-4 (lora), 2e-5 (full)
    batch_tokens: int = 2048  # target tokens per optimizer step
    lora_rank: int = 32
    warmup_steps: int = 5
    checkpoint_minutes: float = 5.0
    seed: int = 0

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else (2e-4 if self.mode == "lora" else 2e-5)


@dataclass
class Cursor:
    epoch: int = 0
    index: int = 0  # position in the epoch's sequence order
    step: int = 0  # optimizer steps done
    tokens: int = 0  # target tokens trained on
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of this process (the cost on a shared machine)
    history: list = field(default_factory=list)  # (step, tokens, loss, top-1) per optimizer step


def load_draft(path: Path, cfg: FinetuneConfig):
    """The draft as a transformers model with only the trained parameters requiring gradients."""
    import warnings  # noqa: PLC0415

    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # transformers' own, harmless
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32 if cfg.mode == "full" else torch.bfloat16)
    except (OSError, ValueError, KeyError) as e:
        raise SpecdecError(f"cannot load the draft in {path} for training: {e}") from e
    if cfg.mode == "full":
        return model
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415

    torch.manual_seed(cfg.seed)  # the adapters' initialization: a run is a function of its options
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    model = get_peft_model(model, lora)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 adapters over the frozen bf16 base
    return model


def lr_at(step: int, total: int, cfg: FinetuneConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def order(n: int, seed: int, epoch: int) -> list[int]:
    idx = list(range(n))
    random.Random(seed * 1000003 + epoch).shuffle(idx)
    return idx


def sequence_loss(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of ``output`` after ``prompt`` and how many tokens the argmax got right."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, logits_to_keep=len(output)).logits[0].float()  # (n, V)
    target = torch.tensor(output)
    return F.cross_entropy(logits, target, reduction="sum"), int((logits.argmax(-1) == target).sum())


def finetune(draft_path: Path, data: list[tuple[list[int], list[int]]], work: Path, cfg: FinetuneConfig,
             desc: str = "distill") -> Path:
    """Train on ``(prompt_ids, output_ids)`` pairs; the merged model lands in ``work/draft``."""
    from specdec.formats.progress import bar as progress_bar  # noqa: PLC0415

    final = work / "draft"
    if (final / "model.safetensors").is_file() and (final / "training.json").is_file():
        return final
    work.mkdir(parents=True, exist_ok=True)
    model = load_draft(draft_path, cfg)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params = list(trainable.values())
    opt = torch.optim.AdamW(params, lr=cfg.peak_lr, weight_decay=0.0)
    cur = Cursor()
    ck = work / CHECKPOINT
    if ck.is_file():
        state = torch.load(ck, weights_only=False)
        if state["config"] != asdict(cfg):
            raise SpecdecError(f"{ck} was written with other training options ({state['config']}): "
                               "rerun with the same options, or delete it to start over")
        model.load_state_dict(state["weights"], strict=False)
        opt.load_state_dict(state["optimizer"])
        cur = Cursor(**state["cursor"])
    per_epoch = sum(len(o) for _, o in data)
    total_tokens = int(per_epoch * cfg.epochs)
    total_steps = max(1, math.ceil(total_tokens / cfg.batch_tokens))

    def save() -> None:
        weights = {n: p.detach().clone() for n, p in trainable.items()}
        tmp = ck.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "weights": weights, "optimizer": opt.state_dict(),
                    "cursor": asdict(cur)}, tmp)
        os.replace(tmp, ck)

    model.train()
    bar = progress_bar(total=total_tokens, initial=min(cur.tokens, total_tokens), desc=desc, unit="tok", dynamic_ncols=True)
    last_save, t0, c0, acc_tokens, acc_loss, acc_hits = time.monotonic(), time.monotonic(), time.process_time(), 0, 0.0, 0
    ema = None
    while cur.tokens < total_tokens and cur.epoch < math.ceil(cfg.epochs):
        seq_order = order(len(data), cfg.seed, cur.epoch)
        while cur.index < len(seq_order) and cur.tokens + acc_tokens < total_tokens:
            prompt, output = data[seq_order[cur.index]]
            loss, hits = sequence_loss(model, prompt, output)
            (loss / cfg.batch_tokens).backward()
            acc_tokens, acc_loss, acc_hits = acc_tokens + len(output), acc_loss + float(loss.detach()), acc_hits + hits
            cur.index += 1
            if acc_tokens >= cfg.batch_tokens or cur.index == len(seq_order):
                for g in opt.param_groups:
                    g["lr"] = lr_at(cur.step, total_steps, cfg)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                cur.step, cur.tokens = cur.step + 1, cur.tokens + acc_tokens
                loss_avg, top1 = acc_loss / acc_tokens, acc_hits / acc_tokens
                cur.history.append((cur.step, cur.tokens, round(loss_avg, 4), round(top1, 4)))
                ema = (loss_avg, top1) if ema is None else (0.8 * ema[0] + 0.2 * loss_avg, 0.8 * ema[1] + 0.2 * top1)
                bar.update(acc_tokens)
                bar.set_postfix(step=cur.step, loss=f"{ema[0]:.3f}", top1=f"{ema[1]:.3f}", epoch=cur.epoch)
                acc_tokens, acc_loss, acc_hits = 0, 0.0, 0
                now = time.monotonic()
                cur.seconds, t0 = cur.seconds + now - t0, now
                cur.cpu_seconds, c0 = cur.cpu_seconds + time.process_time() - c0, time.process_time()
                if now - last_save >= cfg.checkpoint_minutes * 60:
                    save()
                    last_save = now
        if cur.index >= len(seq_order):
            cur.epoch, cur.index = cur.epoch + 1, 0
    bar.close()
    cur.seconds += time.monotonic() - t0
    cur.cpu_seconds += time.process_time() - c0
    save()
    export(model, draft_path, final, cfg)
    (final / "training.json").write_text(json.dumps({"config": asdict(cfg), "steps": cur.step, "tokens": cur.tokens,
                                                     "seconds": round(cur.seconds, 1),
                                                     "cpu_seconds": round(cur.cpu_seconds, 1), "history": cur.history},
                                                    indent=1))
    return final


def export(model, source: Path, out: Path, cfg: FinetuneConfig) -> None:
    """The trained draft as a model directory (bf16 safetensors + the source's config and tokenizer)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    if cfg.mode == "lora":
        model = model.merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    sd = {n: t.detach().to(torch.bfloat16).contiguous().clone() for n, t in model.state_dict().items()
          if not (tied and n == "lm_head.weight")}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    conf = json.loads((tmp / "config.json").read_text())
    conf["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(conf, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
