"""Hidden-state extraction with specdec's own runtime, cached on disk in shards, resumable.

Every training sequence is prefilled through the target (bf16, or int4 with ``--quantization``) in
one cache row; the hidden states of the head's layers (EAGLE-3: three; Medusa: none) and the final normed state (the
target's distribution is its LM head applied to it, at training time, over the draft vocabulary
only) are written per token in bf16. A shard is a safetensors file of consecutive sequences:

    tokens (N,) int32 | offsets (S+1,) int64 | feats (N, 3C) bf16 (absent without layers) | final (N, C) bf16

written to a temporary name and renamed, then ``progress.json`` (also renamed into place) records
how many sequences are done: an interruption at any point loses at most the shard being written.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models.runner import ModelRunner

PROGRESS = "progress.json"


@dataclass
class Corpus:
    """Tokenized training sequences: ``ids`` flat, sequence i is ``ids[offsets[i]:offsets[i+1]]``."""

    ids: torch.Tensor  # (N,) int32
    offsets: torch.Tensor  # (S+1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def seq(self, i: int) -> list[int]:
        return self.ids[int(self.offsets[i]):int(self.offsets[i + 1])].tolist()

    @classmethod
    def from_lists(cls, seqs: list[list[int]]) -> "Corpus":
        lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.long)
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
        return cls(flat, lens.cumsum(0))

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415
        tmp = path.with_suffix(".tmp")
        save_file({"ids": self.ids.contiguous(), "offsets": self.offsets.contiguous()}, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Corpus":
        from safetensors.torch import load_file  # noqa: PLC0415
        d = load_file(str(path))
        return cls(d["ids"], d["offsets"])


def read_progress(out: Path) -> dict:
    p = out / PROGRESS
    return json.loads(p.read_text()) if p.is_file() else {"sequences": 0, "tokens": 0, "shards": []}


def write_json(path: Path, d: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(d, indent=1))
    os.replace(tmp, path)


@torch.inference_mode()
def extract(runner: ModelRunner, corpus: Corpus, layers: tuple[int, ...], out: Path, shard_tokens: int = 65536,
            progress: bool = True) -> dict:
    """Write the features of every sequence of ``corpus`` not yet done into shards under ``out``."""
    from safetensors.torch import save_file  # noqa: PLC0415
    from specdec.formats.progress import bar as progress_bar  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    state = read_progress(out)
    want = tuple(dict.fromkeys((*layers, -1)))
    total = int(corpus.offsets[-1])
    bar = progress_bar(total=total, initial=int(corpus.offsets[state["sequences"]]), unit="tok", desc="extract",
               disable=not progress, smoothing=0.05)
    buf: dict[str, list[torch.Tensor]] = {"tokens": [], "feats": [], "final": []}
    lens: list[int] = []
    i = state["sequences"]
    while i < len(corpus):
        ids = corpus.seq(i)
        i += 1
        if len(ids) >= 2:
            runner.ensure_cache(1, len(ids) + 1)
            fwd = runner.prefill(0, ids, hidden_layers=want)
            buf["tokens"].append(torch.tensor(ids, dtype=torch.int32))
            if layers:
                buf["feats"].append(torch.cat([fwd.hidden[j][0] for j in layers], dim=-1).to(torch.bfloat16))
            buf["final"].append(fwd.hidden[-1][0].to(torch.bfloat16))
            lens.append(len(ids))
        bar.update(len(ids))
        if sum(lens) >= shard_tokens or (i == len(corpus) and lens):
            name = f"shard-{len(state['shards']):05d}.safetensors"
            offsets = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
            tmp = out / (name + ".tmp")
            save_file({"offsets": offsets, **{k: torch.cat(v) for k, v in buf.items() if v}}, str(tmp))
            os.replace(tmp, out / name)
            state = {"sequences": i, "tokens": state["tokens"] + sum(lens), "shards": state["shards"] + [name]}
            write_json(out / PROGRESS, state)
            buf = {k: [] for k in buf}
            lens = []
    if i == len(corpus) and state["sequences"] != i:  # trailing one-token sequences
        state["sequences"] = i
        write_json(out / PROGRESS, state)
    bar.close()
    return state
