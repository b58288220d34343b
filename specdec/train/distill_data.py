"""What `specdec distill` learns from: prompts and the target's own outputs for them.

Prompts come from files in the benchmark's format (Spec-Bench ``turns`` records or raw ``prompt``
records, ``tools/bench/prompts.py``), from any training-data source of ``specdec train`` (``sharegpt``,
a ``.jsonl`` of messages: the first user turn is the prompt), or from traffic recorded by
``specdec serve --record-traffic DIR`` (prompt and the target's output, already tokenized: nothing to
generate). Each prompt is tokenized the way the engine sees it (the chat template for chats), and a
stable hash of its id puts it in the held-out set or in training.

The target's outputs are generated in batches and appended to ``targets.jsonl`` one line per prompt
as they finish: an interrupted run keeps every finished prompt and the next run generates the rest.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError
from specdec.train.data import stable_hash


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: tuple[int, ...]  # the prompt's tokens, as the engine sees them
    output_ids: tuple[int, ...] = ()  # the target's output, when it came with the prompt (traffic)



def _prompt_files(spec: str, tokenizer, max_prompt: int, categories: list[str] | None) -> Iterator[Prompt]:
    """A benchmark prompt file, or a training-data source (first user turn of each chat)."""
    from specdec.home import specdec_home  # noqa: PLC0415
    from specdec.tools.bench.prompts import load_prompts  # noqa: PLC0415
    from specdec.train.data import iter_source, parse_spec  # noqa: PLC0415

    path = Path(parse_spec(spec)[0]).expanduser()
    if spec == "packaged" or (path.is_file() and path.suffix == ".jsonl" and _is_bench_file(path)):
        for p in load_prompts(None if spec == "packaged" else path, categories):
            ids = (tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}]) if p.is_chat
                   else tokenizer.encode(p.prompt))
            yield Prompt(f"{path.name}:{p.question_id}", tuple(ids[-max_prompt:]))
        return
    for rec in iter_source(spec, specdec_home() / "wheels" / "training-data"):
        msgs = rec.prompt_messages()
        ids = tokenizer.apply_chat_template(msgs) if msgs else tokenizer.encode((rec.text or "")[:4 * max_prompt])
        if len(ids) >= 4:
            yield Prompt(rec.id, tuple(ids[-max_prompt:]))


def _is_bench_file(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise SpecdecError(f"{path} line 1 is not JSON ({e}): fix or drop it") from e
                return isinstance(rec, dict) and ("turns" in rec or ("prompt" in rec and "completion" not in rec))
    raise SpecdecError(f"{path} holds no prompts")


def traffic_prompts(directory: Path, max_prompt: int) -> Iterator[Prompt]:
    """Recorded requests (``serve --record-traffic``): prompt and output token ids, as served."""
    from specdec.server.traffic import PATTERN  # noqa: PLC0415

    files = sorted(directory.glob(PATTERN)) if directory.is_dir() else []
    if not files:
        raise SpecdecError(f"no recorded traffic in '{directory}': record some with "
                           "`specdec serve --record-traffic DIR`")
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            try:
                rec = json.loads(line)
                ids, out = [int(t) for t in rec["prompt_ids"]], [int(t) for t in rec["output_ids"]]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash of the server: skip it
            if ids and out:
                yield Prompt(f"{f.name}:{n}", tuple(ids[-max_prompt:]), tuple(out))


def load_prompts(specs: list[str], traffic: str | None, tokenizer, max_prompt: int, limit: int | None = None,
                 categories: list[str] | None = None) -> list[Prompt]:
    """Every prompt of the given sources (``limit`` in all; ``categories`` filters benchmark files),
    duplicates dropped."""
    it: Iterator[Prompt] = (traffic_prompts(Path(traffic), max_prompt) if traffic else
                            (p for s in specs for p in _prompt_files(s, tokenizer, max_prompt, categories)))
    seen, out = set(), []
    for p in it:
        if p.ids in seen:
            continue
        seen.add(p.ids)
        out.append(p)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise SpecdecError("no prompts found: give --prompts FILE (benchmark or chat JSONL, or sharegpt) "
                           "or --traffic DIR")
    return out


def read_targets(path: Path) -> dict[str, list[int]]:
    """Outputs generated so far (``targets.jsonl``: one ``{"id", "output_ids"}`` line per prompt)."""
    done: dict[str, list[int]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                done[rec["id"]] = [int(t) for t in rec["output_ids"]]
            except (ValueError, KeyError, TypeError):
                continue  # the half-written last line of an interrupted run
    return done


def generate_targets(target: Callable[[], Any], prompts: list[Prompt], path: Path, max_tokens: int,
                     temperature: float, batch: int = 8, desc: str = "target outputs",
                     use_given: bool = True) -> dict[str, list[int]]:
    """The target's outputs for ``prompts``, appended to ``path`` batch by batch; ``use_given``: a
    prompt that came with its output (recorded traffic) keeps it. ``target()`` gives the target's
    ``LLM``, called only if something is left to generate."""
    from specdec.formats.progress import bar as progress_bar  # noqa: PLC0415

    from specdec import SamplingParams  # noqa: PLC0415

    done = read_targets(path)
    for p in prompts:
        if use_given and p.output_ids and p.id not in done:
            done[p.id] = list(p.output_ids)
    todo = [p for p in prompts if p.id not in done]
    if not todo:
        return done
    llm = target()
    fits = [p for p in todo if len(p.ids) < llm.max_model_len]
    if len(fits) < len(todo):
        print(f"skipped {len(todo) - len(fits)} prompts longer than the target's context "
              f"({llm.max_model_len} tokens)", flush=True)
    bar = progress_bar(total=len(fits) + len(done), initial=len(done), desc=desc, unit="prompt", dynamic_ncols=True)
    with path.open("a", encoding="utf-8") as f:
        for lo in range(0, len(fits), batch):
            part = fits[lo:lo + batch]
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=stable_hash(p.id))
                      for p in part]
            outs = llm.generate([list(p.ids) for p in part], params, num_speculative_tokens=0)
            for p, o in zip(part, outs):
                done[p.id] = list(o.outputs[0].token_ids)
                f.write(json.dumps({"id": p.id, "output_ids": done[p.id]}) + "\n")
            f.flush()
            bar.update(len(part))
            bar.set_postfix(tokens=sum(len(v) for v in done.values()))
    bar.close()
    return done
