"""`specdec train eagle` (and `train medusa`, ``train.medusa``): data -> held-out split -> tokenization -> draft vocabulary -> feature
extraction (shards) -> training (checkpoints) -> export (speculators format) -> acceptance evaluation.

Every stage leaves files under ``--output`` and skips itself when they exist, so re-running the same
command after an interruption resumes where it stopped:

    DIR/data.json            what the data was (sources, records, tokens, held-out ids)
    DIR/eval_prompts.jsonl   held-out prompts (never trained on)
    DIR/corpus.safetensors   tokenized training sequences
    DIR/vocab.safetensors    the draft vocabulary (target ids, most frequent first)
    DIR/features/            extracted hidden states (shards + progress.json)
    DIR/heldout/             the held-out prompts' states (Medusa: its per-head accuracies, heldout.json)
    DIR/checkpoint.pt        training state (head, optimizer, data cursor, history)
    DIR/head/                the head: config.json + model.safetensors (+ eval.json, training.json)
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.train.extract import Corpus
    from specdec.train.train import TrainConfig, WindowLoss


def prepare_data(a: argparse.Namespace, tokenizer, out: Path) -> None:
    """data.json, eval_prompts.jsonl and corpus.safetensors (once)."""
    from specdec.home import specdec_home  # noqa: PLC0415
    from specdec.train.data import held_out, iter_source, tokenize  # noqa: PLC0415
    from specdec.train.extract import Corpus  # noqa: PLC0415

    if (out / "corpus.safetensors").is_file():
        return
    seqs, evals, summary, budget = [], [], [], a.max_tokens
    regen = None
    if getattr(a, "regenerate", False):
        from specdec.train.regenerate import Regenerator  # noqa: PLC0415
        regen = Regenerator(a.model, a.quantization, out, a.regen_max_tokens, a.regen_batch)
    # held-out prompts each source owes the final evaluation: once its token budget is spent, a
    # source is read on (without tokenizing) until it has given them, so a small budget still evaluates
    owed = -(-getattr(a, "final_eval_prompts", 0) // len(a.data)) if a.heldout_per_mille else 0
    for spec in a.data:
        n = toks = held = regenerated = 0
        chats: list = []  # conversations waiting for the target's replies (--regenerate)

        def take(recs, replies: bool = False) -> None:
            nonlocal n, toks, regenerated
            for r in recs:
                ids = tokenize(r, tokenizer, a.max_seq_len)
                if len(ids) >= 8:
                    seqs.append(ids)
                    n, toks, regenerated = n + 1, toks + len(ids), regenerated + replies

        for rec in iter_source(spec, specdec_home() / "wheels" / "training-data"):
            full = budget is not None and toks >= budget / len(a.data)
            if full and held >= owed:
                break
            if held_out(rec.id, a.heldout_per_mille):
                msgs = rec.prompt_messages()
                prompt = {"id": rec.id, "messages": msgs} if msgs else {"id": rec.id, "prompt": (rec.text or "")[:2000]}
                if usable(prompt):  # a conversation with no user turn to ask is no prompt
                    evals.append(prompt)
                    held += 1
                continue
            if full:
                continue
            if regen is not None and rec.messages:
                chats.append(rec)
                if len(chats) >= regen.batch:
                    take(regen.replies(chats), replies=True)
                    chats = []
                continue
            take([rec])
        if chats:
            take(regen.replies(chats), replies=True)
        summary.append({"source": spec, "records": n, "tokens": toks, "heldout": held}
                       | ({"regenerated": regenerated} if regen else {}))
    if regen is not None:
        regen.close()
    if not seqs:
        raise SpecdecError("the training data is empty: give --data sharegpt, stdlib, a .jsonl file or a directory")
    with (out / "eval_prompts.jsonl").open("w") as f:
        for e in evals:
            f.write(json.dumps(e) + "\n")
    (out / "data.json").write_text(json.dumps({
        "model": a.model, "sources": summary, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
        "max_seq_len": a.max_seq_len, "heldout_per_mille": a.heldout_per_mille,
        "heldout_ids": [e["id"] for e in evals]}, indent=1))
    Corpus.from_lists(seqs).save(out / "corpus.safetensors")


def usable(prompt: dict) -> bool:
    """An evaluation prompt with something to ask (checked when held out, and again when read: files
    written before empty ones were dropped)."""
    return bool(prompt["messages"][0]["content"].strip() if "messages" in prompt else prompt.get("prompt", "").strip())


def draft_vocab(corpus, vocab_size: int, size: int, out: Path) -> torch.Tensor:
    """The ``size`` most frequent target tokens of the corpus (ties: lower id), saved once."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415
    path = out / "vocab.safetensors"
    if path.is_file():
        return load_file(str(path))["d2t_ids"]
    counts = torch.bincount(corpus.ids.long(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) * 1e-9  # stable order among ties
    ids = counts.argsort(descending=True)[:size].sort().values
    save_file({"d2t_ids": ids.contiguous()}, str(path))
    return ids


def evaluate(model: str, head_dir: Path, prompts: list[dict], max_tokens: int, k: int, quantization: str | None,
             llm_box: dict, method: str = "eagle") -> dict:
    """Greedy acceptance of the head on held-out prompts (acceptance, not speed)."""
    from specdec import LLM, SamplingParams  # noqa: PLC0415
    from specdec.metrics import aggregate  # noqa: PLC0415
    cfg = {"method": method, "model": str(head_dir), "num_speculative_tokens": k}
    if "llm" not in llm_box:
        llm_box["llm"] = LLM(model=model, quantization=quantization, progress=False, speculative_config=cfg)
    llm = llm_box["llm"]
    llm.set_speculative_config(cfg, reload=True)  # a new checkpoint under the same path: read it again
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = [(llm.chat(p["messages"], params) if "messages" in p else llm.generate(p["prompt"][-1500:], params))[0]
            for p in prompts]
    m = aggregate(outs)
    return {"eval_prompts": len(prompts), "eval_tokens": m.num_generated_tokens, "k": k,
            "mean_accepted_length": round(m.mean_accepted_length, 3), "acceptance_rate": round(m.acceptance_rate, 4),
            "acceptance_by_position": [round(x, 4) for x in m.acceptance_by_position]}


@dataclass
class HeadKind:
    """What one kind of head brings to the shared pipeline (``run_pipeline``)."""

    method: str  # its speculative method, for the acceptance evaluation
    layers: tuple[int, ...]  # target layers extracted beside the final normed state
    head: nn.Module
    loss: Callable[["TrainConfig"], WindowLoss]  # the window loss under a training config
    save: Callable[[Path], object]  # export the head into a directory
    metrics: int  # accuracies the loss reports
    eval_k: int = 5
    after_training: Callable[[list[Path]], dict] | None = None  # on held-out features: what to record


def heldout_corpus(prompts: list[dict], tokenizer, max_len: int) -> "Corpus":
    """The held-out prompts tokenized as training records are."""
    from specdec.train.data import Record, tokenize  # noqa: PLC0415
    from specdec.train.extract import Corpus  # noqa: PLC0415
    recs = [Record(str(p["id"]), "heldout", text=p.get("prompt"), messages=p.get("messages") or []) for p in prompts]
    return Corpus.from_lists([ids for ids in (tokenize(r, tokenizer, max_len) for r in recs) if len(ids) >= 2])


def run_pipeline(a: argparse.Namespace, build: Callable[[object, "Corpus", Path], HeadKind]) -> int:
    """data -> features -> training (checkpoints) -> export -> acceptance, for the head ``build(target,
    corpus, out)`` makes (every stage resumable; see the module docstring)."""
    from specdec.formats.loader import LoadedModel  # noqa: PLC0415
    from specdec.models.runner import WHOLE_CHUNK, ModelRunner  # noqa: PLC0415
    from specdec.train.extract import Corpus, extract, read_progress  # noqa: PLC0415
    from specdec.train.report import plot_training  # noqa: PLC0415
    from specdec.train.train import TrainConfig, train  # noqa: PLC0415

    torch.set_num_threads(a.threads)
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    target = LoadedModel(a.model, torch.bfloat16, torch.device("cpu"), quantization=a.quantization)
    print(f"[1/4] data -> {out / 'data.json'}", flush=True)
    prepare_data(a, target.tokenizer, out)
    corpus = Corpus.load(out / "corpus.safetensors")
    prompts = [p for p in (json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()
                           if line.strip()) if usable(p)]
    kind = build(target, corpus, out)
    print(f"[2/4] features of {len(corpus)} sequences, {int(corpus.offsets[-1])} tokens -> {out / 'features'}",
          flush=True)
    runner = ModelRunner(target.model, prefill_chunk=WHOLE_CHUNK)  # features as earlier runs extracted them
    state = extract(runner, corpus, kind.layers, out / "features")
    shards = [out / "features" / s for s in read_progress(out / "features")["shards"]]
    held: list[Path] = []
    if kind.after_training is not None and prompts:
        extract(runner, heldout_corpus(prompts, target.tokenizer, a.max_seq_len), kind.layers, out / "heldout")
        held = [out / "heldout" / s for s in read_progress(out / "heldout")["shards"]]
    del target, runner  # the runtime copy: training needs only the tables the loss holds
    box: dict = {}

    def on_checkpoint(cur, entry: dict) -> dict:
        kind.save(out / "head")
        (out / "head" / "training.json").write_text(json.dumps(
            {"data": json.loads((out / "data.json").read_text())["sources"], **entry}, indent=1))
        if a.eval_prompts <= 0 or not prompts:
            return {}
        return evaluate(a.model, out / "head", prompts[:a.eval_prompts], a.eval_tokens, kind.eval_k, a.quantization,
                        box, kind.method)

    tc = TrainConfig(epochs=a.epochs, seq_len=a.seq_len, batch_tokens=a.batch_tokens, lr=a.lr,
                     ttt_steps=getattr(a, "ttt_steps", 1), checkpoint_minutes=a.checkpoint_minutes, seed=a.seed)
    print(f"[3/4] training ({tc.epochs} epochs over {state['tokens']} tokens; checkpoint every "
          f"{tc.checkpoint_minutes} min) -> {out / 'checkpoint.pt'}", flush=True)
    _, history = train(kind.head, kind.loss(tc), shards, state["tokens"], out, tc, on_checkpoint,
                       metrics=kind.metrics)
    kind.head.eval()
    if kind.after_training is not None and held:
        (out / "heldout.json").write_text(json.dumps(kind.after_training(held), indent=1))
    kind.save(out / "head")
    if prompts:
        print(f"[4/4] acceptance on {min(len(prompts), a.final_eval_prompts)} held-out prompts", flush=True)
        res = evaluate(a.model, out / "head", prompts[:a.final_eval_prompts], a.eval_tokens, kind.eval_k,
                       a.quantization, box, kind.method)
        (out / "head" / "eval.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res), flush=True)
    curve = plot_training(history, out / "head" / "training.png", f"specdec train {kind.method}: {out.name}",
                          res if prompts else None)
    print(f"training curve: {curve}", flush=True)
    print(f"head: {out / 'head'}  (use: speculative_config={{'method': '{kind.method}', 'model': '{out / 'head'}'}})")
    return 0


def eagle_kind(a: argparse.Namespace) -> Callable[[object, "Corpus", Path], HeadKind]:
    """The EAGLE-3 head of ``specdec train eagle``: draft vocabulary from the corpus, LM head rows as its start."""
    from specdec.heads.eagle import EagleConfig, EagleHead, init_head  # noqa: PLC0415
    from specdec.heads.speculators import save_head  # noqa: PLC0415
    from specdec.train.train import eagle_loss  # noqa: PLC0415

    def build(target, corpus, out: Path) -> HeadKind:
        ids = draft_vocab(corpus, target.config.vocab_size, a.draft_vocab_size, out)
        aux = tuple(a.aux_layers) if a.aux_layers else None
        cfg = EagleConfig.for_target(target.config, len(ids), a.intermediate_size, aux)
        embed = target.weight(("model.embed_tokens.weight", "embed_tokens.weight"))
        lm = embed if target.config.tie_word_embeddings else target.weight(("lm_head.weight",))
        lm_rows = lm[ids].to(torch.bfloat16)  # (Vd, C)
        head = init_head(EagleHead(cfg), seed=a.seed)
        head.set_vocab(ids)
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_rows.float())  # start from the target's own rows (EAGLE-3)
        verifier = {"name_or_path": a.model, "architectures": ["LlamaForCausalLM"]}
        return HeadKind("eagle", cfg.target_layers, head, lambda tc: eagle_loss(head, embed, lm_rows, tc),
                        lambda d: save_head(d, head, verifier), a.ttt_steps)
    return build


def run(a: argparse.Namespace) -> int:
    return run_pipeline(a, eagle_kind(a))
