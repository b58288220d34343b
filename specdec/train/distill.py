"""`specdec distill`: fine-tune a draft model on the target's own outputs for the user's prompts.

prompts (``--prompts`` or ``--traffic``) -> held-out split -> the target's outputs -> acceptance
before -> fine-tuning (LoRA or full) -> acceptance after -> ``OUTPUT/draft`` (a model directory:
``--speculative-model OUTPUT/draft``) and ``OUTPUT/report.md``.

Every stage leaves files under ``--output`` and a rerun of the same command resumes after the last
one it finished:

    DIR/split.json           the prompts' ids: training, held out, other domains (what the data was)
    DIR/eval_prompts.jsonl   the held-out and other-domain prompts for `specdec bench --prompts`
    DIR/targets.jsonl        the target's outputs, one line per prompt as it finished
    DIR/eval_before.json     acceptance of the original draft on the held-out prompts
    DIR/checkpoint.pt        training state (trainable weights, optimizer, cursor, history)
    DIR/draft/               the fine-tuned draft (+ training.json)
    DIR/speed.json           tokens/s of plain, the original and the fine-tuned draft (``--speed-prompts``)
    DIR/eval.json, report.md acceptance (and speed) before and after, per prompt set

Acceptance is greedy chain acceptance at K draft tokens computed exactly from the target's greedy
outputs (``train/acceptance.py``), on the held-out prompts of the training domain and on prompts of
other domains (``--eval-others``, default the packaged prompt set), so a draft that learns one
domain and forgets the others shows it.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from specdec.errors import SpecdecError


def _split(a: argparse.Namespace, tokenizer, out: Path) -> dict[str, list]:
    """Training, held-out and other-domain prompts (fixed at the first run: split.json)."""
    from specdec.train.data import held_out  # noqa: PLC0415
    from specdec.train.distill_data import Prompt, load_prompts  # noqa: PLC0415

    path = out / "split.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["sources"] != _sources(a):
            raise SpecdecError(f"{out} holds a run on other prompts ({saved['sources']}): use another --output")
        return {k: [Prompt(p["id"], tuple(p["ids"]), tuple(p.get("output_ids", ()))) for p in saved[k]]
                for k in ("train", "heldout", "others")}
    prompts = load_prompts(a.prompts, a.traffic, tokenizer, a.max_prompt_tokens, a.limit, a.categories)
    heldout = [p for p in prompts if held_out(p.id, a.heldout_per_mille)][:a.eval_prompts]
    kept_out = {p.id for p in heldout}
    train = [p for p in prompts if p.id not in kept_out]
    if not train:
        raise SpecdecError(f"all {len(prompts)} prompts were held out: give more prompts")
    seen = {p.ids for p in prompts}
    others = [p for p in load_prompts(a.eval_others, None, tokenizer, a.max_prompt_tokens) if p.ids not in seen
              ][:a.eval_prompts] if a.eval_others else []
    split = {"train": train, "heldout": heldout, "others": others}
    path.write_text(json.dumps({"sources": _sources(a), **{
        k: [{"id": p.id, "ids": list(p.ids), **({"output_ids": list(p.output_ids)} if p.output_ids else {})}
            for p in v] for k, v in split.items()}}))
    return split


def _bench_prompts(split: dict[str, list], tokenizer, path: Path) -> None:
    """The held-out and other-domain prompts as a `specdec bench` file (raw prompts: the chat template
    already applied), so the distilled draft's speed can be measured on them."""
    with path.open("w", encoding="utf-8") as f:
        for name in ("heldout", "others"):
            for p in split[name]:
                f.write(json.dumps({"question_id": p.id, "category": name,
                                    "prompt": tokenizer.decode(p.ids, skip_special_tokens=False)}) + "\n")


def _sources(a: argparse.Namespace) -> dict:
    return {"target": a.target, "prompts": a.prompts, "traffic": a.traffic, "categories": a.categories,
            "limit": a.limit, "eval_others": a.eval_others, "heldout_per_mille": a.heldout_per_mille}


def _outputs(a: argparse.Namespace, split: dict[str, list], out: Path
             ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The target's outputs: for training (recorded ones kept, others sampled at --temperature) and
    for evaluation (greedy, always generated here)."""
    from functools import cache  # noqa: PLC0415

    from specdec import LLM  # noqa: PLC0415
    from specdec.train.distill_data import generate_targets  # noqa: PLC0415

    target = cache(lambda: LLM(model=a.target, quantization=a.target_quantization, max_num_seqs=a.gen_batch))
    targets = generate_targets(target, split["train"], out / "targets.jsonl", a.max_tokens, a.temperature,
                               a.gen_batch, "target outputs (training)")
    evaluated = generate_targets(target, split["heldout"] + split["others"], out / "eval_targets.jsonl",
                                 a.max_tokens, 0.0, a.gen_batch, "target outputs (evaluation, greedy)",
                                 use_given=False)
    target.cache_clear()  # the target's memory goes before the draft's training
    gc.collect()
    return targets, evaluated


def _acceptance(draft: str | Path, a: argparse.Namespace, split: dict[str, list], outputs: dict[str, list[int]]
                ) -> dict:
    from specdec.formats.loader import LoadedModel  # noqa: PLC0415
    from specdec.train.acceptance import measure  # noqa: PLC0415

    model = LoadedModel(str(draft), torch.bfloat16, torch.device("cpu"), progress=False,
                        quantization=a.draft_quantization)
    res = {}
    for name in ("heldout", "others"):
        pairs = [(list(p.ids), outputs[p.id], a.max_tokens) for p in split[name] if outputs.get(p.id)]
        if pairs:
            res[name] = measure(model, pairs, a.k).summary()
    return res


def _speed(a: argparse.Namespace, draft: Path, tuned: Path, out: Path) -> dict:
    """Tokens/s of plain decoding and of the original and the fine-tuned draft at K, per prompt set
    (``--speed-prompts`` each), interleaved per prompt by the benchmark's own loop; greedy outputs
    checked equal to plain decoding. Kept in ``speed.json``: a rerun does not measure again."""
    path = out / "speed.json"
    if path.is_file():
        return json.loads(path.read_text())
    from specdec import LLM  # noqa: PLC0415
    from specdec.tools.bench.prompts import load_prompts  # noqa: PLC0415
    from specdec.tools.bench.speculative import BenchConfig  # noqa: PLC0415
    from specdec.tools.bench.speculative import run as bench  # noqa: PLC0415

    prompts = load_prompts(out / "eval_prompts.jsonl", None, a.speed_prompts)
    spec = {"method": "draft_model", "num_speculative_tokens": a.k, "quantization": a.draft_quantization}
    configs = [BenchConfig("plain", None), BenchConfig("before", dict(spec, model=str(draft)), a.k),
               BenchConfig("after", dict(spec, model=str(tuned)), a.k)]
    llm = LLM(model=a.target, quantization=a.target_quantization, progress=False)
    records = bench(llm, prompts, configs, a.max_tokens)
    res: dict = {"k": a.k, "max_tokens": a.max_tokens, "mismatches": sum(r["identical_to_plain"] is False for r in records)}
    for name in ("heldout", "others"):
        rs = [r for r in records if r["category"] == name]
        if not rs:
            continue
        rate = {c.name: sum(r["num_tokens"] for r in rs if r["config"] == c.name)
                / sum(r["wall_seconds"] for r in rs if r["config"] == c.name) for c in configs}
        res[name] = {"prompts": len(rs) // len(configs), "tok_s": {c: round(v, 2) for c, v in rate.items()},
                     "speedup": {c: round(rate[c] / rate["plain"], 3) for c in ("before", "after")}}
    del llm
    gc.collect()
    path.write_text(json.dumps(res, indent=1))
    return res


def run(a: argparse.Namespace) -> int:
    from specdec.formats.hub import resolve_model  # noqa: PLC0415
    from specdec.formats.tokenizer import Tokenizer  # noqa: PLC0415
    from specdec.train.finetune import FinetuneConfig, finetune  # noqa: PLC0415
    from specdec.train.report import write_report  # noqa: PLC0415

    torch.set_num_threads(a.threads)
    if not a.prompts and not a.traffic:
        raise SpecdecError("give --prompts FILE (or sharegpt) or --traffic DIR")
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    target_path, draft_path = resolve_model(a.target), resolve_model(a.draft)
    tok, dtok = Tokenizer(target_path), Tokenizer(draft_path)
    if tok.hf.get_vocab() != dtok.hf.get_vocab():
        raise SpecdecError(f"{a.draft} does not share {a.target}'s tokenizer: a draft must")
    split = _split(a, tok, out)
    _bench_prompts(split, tok, out / "eval_prompts.jsonl")
    print(f"[1/5] prompts: {len(split['train'])} training, {len(split['heldout'])} held out, "
          f"{len(split['others'])} of other domains -> {out / 'split.json'}", flush=True)
    targets, evaluated = _outputs(a, split, out)
    before_path = out / "eval_before.json"
    if not before_path.is_file():
        print(f"[2/5] acceptance of {a.draft} before (K={a.k}, greedy, held-out prompts)", flush=True)
        before_path.write_text(json.dumps(_acceptance(draft_path, a, split, evaluated), indent=1))
    before = json.loads(before_path.read_text())
    data = [(list(p.ids), targets[p.id]) for p in split["train"] if len(targets.get(p.id, ())) >= 2]
    cfg = FinetuneConfig(mode=a.mode, epochs=a.epochs, lr=a.lr, batch_tokens=a.batch_tokens, lora_rank=a.lora_rank,
                         checkpoint_minutes=a.checkpoint_minutes, seed=a.seed)
    print(f"[3/5] fine-tuning ({a.mode}) on {len(data)} outputs, {sum(len(o) for _, o in data)} target tokens, "
          f"{a.epochs} epochs; checkpoint every {a.checkpoint_minutes} min -> {out / 'checkpoint.pt'}", flush=True)
    final = finetune(draft_path, data, out, cfg)
    gc.collect()
    print("[4/5] acceptance after", flush=True)
    after = _acceptance(final, a, split, evaluated)
    training = json.loads((final / "training.json").read_text())
    result = {"target": a.target, "draft": a.draft, "k": a.k, "draft_quantization": a.draft_quantization,
              "before": before, "after": after, "training": {k: training.get(k) for k in ("config", "steps", "tokens", "seconds",
                                                                                          "cpu_seconds")},
              "prompts": {k: len(v) for k, v in split.items()}}
    if a.speed_prompts:
        print(f"[5/5] speed: plain, {a.draft} and the fine-tuned draft, {a.speed_prompts} prompts per set "
              "(needs a quiet machine)", flush=True)
        result["speed"] = _speed(a, draft_path, final, out)
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    (final / "eval.json").write_text(json.dumps(result, indent=1))
    write_report(result, training["history"], out)
    for name in ("heldout", "others"):
        if name in before and name in after:
            b, f = before[name]["acceptance_rate"], after[name]["acceptance_rate"]
            print(f"{name}: acceptance {b:.1%} -> {f:.1%} ({(f / b - 1) if b else 0:+.0%}); tokens per step "
                  f"{before[name]['mean_accepted_length']} -> {after[name]['mean_accepted_length']}")
    for name, v in result.get("speed", {}).items():
        if isinstance(v, dict):
            print(f"{name}: speedup over plain {v['speedup']['before']:.2f}x -> {v['speedup']['after']:.2f}x "
                  f"({v['prompts']} prompts, {a.max_tokens} tokens)")
    print(f"draft: {final}  (use: --speculative-model {final})  report: {out / 'report.md'}")
    return 0
