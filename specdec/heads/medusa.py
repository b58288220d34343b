"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads") and their directory on disk.

Head k (k = 1..H) is one residual block on the target's last hidden state ``h_t``, here the output of
the target's final norm (what its LM head reads; ``ForwardOutput.hidden[-1]``), the same in
training and drafting:

    h_k = h_t + SiLU(W_k h_t + b_k)          logits_k = lm_head(h_k)     (the target's LM head, shared)

The target's own head on ``h_t`` gives token t+1; Medusa head k gives token t+1+k.

A head set is a directory (the original Medusa's ``medusa_num_heads`` / ``medusa_num_layers`` /
``base_model_name_or_path`` names)::

    config.json         {"architectures": ["MedusaHeads"], "medusa_num_heads": H, "medusa_num_layers": 1,
                         "hidden_size": C, "vocab_size": V, "hidden_state": "final_norm",
                         "base_model_name_or_path": ..., "top_accuracies": [[acc of top-1, top-2, ...] per head],
                         "torch_dtype": "bfloat16"}
    model.safetensors   heads.{k-1}.linear.weight (C, C), heads.{k-1}.linear.bias (C,)   (no LM head)
                        [vocab (Vd,) int64: the target ids the heads draft from, when trained on a
                         training vocabulary: drafting reads only those rows of the LM head]

``top_accuracies[k-1][i]``: P(the target's token is head k's (i+1)-th most probable), measured on
held-out data by ``specdec train medusa``; the candidate tree is chosen from them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError

WEIGHTS = "model.safetensors"
ARCH = "MedusaHeads"


def prior_accuracies(num_heads: int, topk: int = 8) -> list[list[float]]:
    """Accuracies assumed for a head set that has none measured (an untrained one): decaying by depth
    and rank, so the greedy tree still prefers shallow top-ranked nodes."""
    return [[0.6 ** (k + 1) * 0.5 ** i for i in range(topk)] for k in range(num_heads)]


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    top_accuracies: list[list[float]] = field(default_factory=list)  # per head, per rank
    target: str = ""  # the model it was trained for

    def accuracies(self) -> list[list[float]]:
        return self.top_accuracies or prior_accuracies(self.num_heads)

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": [ARCH], "medusa_num_heads": self.num_heads, "medusa_num_layers": 1,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "hidden_state": "final_norm",
                "base_model_name_or_path": self.target, "top_accuracies": self.top_accuracies,
                "torch_dtype": "bfloat16"}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> "MedusaConfig":
        if ARCH not in d.get("architectures", []):
            raise SpecdecError(f"{where} is not a Medusa head set (architectures {d.get('architectures')!r}, "
                               f"want [{ARCH!r}])")
        try:
            if int(d.get("medusa_num_layers", 1)) != 1:
                raise SpecdecError(f"{where}: only one residual block per head is supported")
            return cls(hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]),
                       num_heads=int(d["medusa_num_heads"]),
                       top_accuracies=[[float(x) for x in row] for row in d.get("top_accuracies") or []],
                       target=str(d.get("base_model_name_or_path") or ""))
        except (KeyError, TypeError, ValueError) as e:
            raise SpecdecError(f"{where} lacks or mangles field {e}: point to a Medusa head directory "
                               "(config.json + model.safetensors)") from e


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.linear = nn.Linear(c, c)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """H residual blocks; ``forward(h (..., C)) -> (..., H, C)``, the LM head's inputs for tokens t+2..t+1+H."""

    def __init__(self, c: MedusaConfig) -> None:
        super().__init__()
        self.config = c
        self.heads = nn.ModuleList(ResBlock(c.hidden_size) for _ in range(c.num_heads))

        self.vocab: torch.Tensor | None
        # (Vd,) target ids: the rows of the LM head it drafts from (saved by ``save_heads``, not in
        # the state dict: training checkpoints hold the trained weights only)
        self.register_buffer("vocab", None, persistent=False)

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft over these target ids only (the training vocabulary), or over the whole LM head (None)."""
        self.vocab = None if ids is None else ids.to(torch.long).clone()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(h) for head in self.heads], dim=-2)


def init_heads(heads: MedusaHeads, seed: int = 0, std: float = 0.0) -> MedusaHeads:
    """Medusa's initialization (``std = 0``: W = 0, b = 0, so head k starts as the target's next-token
    head); ``std > 0``: random weights (an untrained head set that drafts something else, for tests)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return heads


def save_heads(out_dir: Path | str, heads: MedusaHeads, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` atomically."""
    from safetensors.torch import save_file  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous().cpu() for k, v in heads.state_dict().items()}
    if heads.vocab is not None:
        sd["vocab"] = heads.vocab.detach().cpu().contiguous()
    save_file(sd, str(out / (WEIGHTS + ".tmp")), metadata={"format": "pt"})
    os.replace(out / (WEIGHTS + ".tmp"), out / WEIGHTS)
    (out / "config.json.tmp").write_text(json.dumps(heads.config.to_dict(), indent=1) + "\n")
    os.replace(out / "config.json.tmp", out / "config.json")
    return out


def load_heads(path: Path | str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> MedusaHeads:
    """MedusaHeads from a head directory; one clear error for anything missing."""
    from safetensors.torch import load_file  # noqa: PLC0415

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise SpecdecError(f"'{path}' is not a Medusa head directory (it needs config.json and {WEIGHTS}): "
                           "train one with `specdec train medusa`")
    try:
        d = json.loads((path / "config.json").read_text())
        sd = load_file(str(path / WEIGHTS))
    except Exception as e:  # json and safetensors raise their own error types
        raise SpecdecError(f"could not read '{path}' ({str(e).splitlines()[0]}): the head set is damaged") from e
    heads = MedusaHeads(MedusaConfig.from_dict(d, str(path / "config.json")))
    vocab = sd.pop("vocab", None)
    if vocab is not None:
        if vocab.dtype != torch.int64 or vocab.dim() != 1 or not len(vocab) or \
                int(vocab.min()) < 0 or int(vocab.max()) >= heads.config.vocab_size:
            raise SpecdecError(f"{path / WEIGHTS}: its 'vocab' is not a list of target token ids below "
                               f"{heads.config.vocab_size}: the head set is damaged")
        heads.set_vocab(vocab)
    missing, unexpected = heads.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise SpecdecError(f"{path / WEIGHTS} does not match its config.json: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    return heads.to(device=device, dtype=dtype).eval()  # (an integer buffer keeps its dtype)
