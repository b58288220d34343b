"""The drafters `specdec tune` can try for a target, by name.

    ngram                  prompt lookup (free)
    suffix                 suffix-tree drafting over the prompt, the output and past outputs
    self-int4              the target's own weights at int4 (layer_skip with no layer skipped)
    cascade-self           n-gram -> int4 self-draft -> target
    draft:NAME[:WEIGHTS]   a draft model (embedded name or HF directory) at int4 (default), int8 or bf16
    eagle:DIR              a trained feature head (`specdec train eagle`)

Without ``--candidates`` every free and self drafter is tried (the self drafters only for an unquantized
target), plus each embedded model already in the local cache (its GGUF file, or `specdec pull`'s
conversion) that is smaller than the target (its tokenizer is checked when it
loads: a draft of another family is skipped with the reason).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError

FIXED = {
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "self-int4": {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0, "search_steps": 0},
    "cascade-self": {"method": "cascade-self"},
}
SELF_DRAFTS = ("self-int4", "cascade-self")  # need the target's bf16 weights to quantize
WEIGHTS = {"int4": "int4", "int8": "int8", "bf16": None}


@dataclass(frozen=True)
class Candidate:
    name: str
    spec: dict  # speculative_config without num_speculative_tokens


def parse(name: str) -> Candidate:
    """A candidate from its name (see the module docstring); unknown names are an error."""
    if name in FIXED:
        return Candidate(name, dict(FIXED[name]))
    kind, _, rest = name.partition(":")
    if kind == "draft" and rest:
        model, _, weights = rest.rpartition(":") if rest.rsplit(":", 1)[-1] in WEIGHTS else (rest, "", "int4")
        spec = {"method": "draft_model", "model": model}
        if WEIGHTS[weights]:
            spec["quantization"] = WEIGHTS[weights]
        return Candidate(name, spec)
    if kind == "eagle" and rest:
        return Candidate(name, {"method": "eagle", "model": rest})
    raise SpecdecError(f"unknown candidate {name!r}: use {', '.join(FIXED)}, draft:MODEL[:int4|int8|bf16] or "
                       "eagle:DIR")


def model_bytes(path: Path) -> int:
    """Bytes of a model's weights on disk: a GGUF file's size, a directory's safetensors."""
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


def discover(target: str, target_path: Path, quantized: bool) -> list[Candidate]:
    """The default candidates for ``target`` (see the module docstring): ``target_path`` its directory or the GGUF
    file it runs from in place; an embedded model counts as cached in either form, sized in the target's."""
    from specdec.home import specdec_home  # noqa: PLC0415
    from specdec.formats.registry import embedded_models  # noqa: PLC0415

    names = ["ngram", "suffix"] + ([] if quantized else list(SELF_DRAFTS))
    size = model_bytes(target_path)
    for name, entry in embedded_models().items():
        local = specdec_home() / "models" / name
        gguf = specdec_home() / "gguf" / entry.gguf_file
        local = gguf if Path(target_path).is_file() or not (local / "config.json").is_file() else local
        if name != target and local.exists() and 0 < model_bytes(local) < size / 2:
            names.append(f"draft:{name}")
    return [parse(n) for n in names]
