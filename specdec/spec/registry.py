"""Speculation method name -> proposer factory. The engine never branches on the method's name."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specdec.config import SpeculativeConfig
from specdec.errors import SpecdecError
from specdec.spec.base import Proposer

if TYPE_CHECKING:
    from specdec.llm import LLM


def _draft_model(cfg: SpeculativeConfig, llm: "LLM") -> Proposer:
    from specdec.llm import LoadedModel  # noqa: PLC0415
    from specdec.spec.draft_model import DraftModelProposer  # noqa: PLC0415
    if not cfg.model:
        raise SpecdecError("method 'draft_model' needs a draft model: set speculative_config['model'] "
                           "(CLI: --speculative-model NAME_OR_PATH)")
    draft = LoadedModel(cfg.model, llm.dtype, llm.device, progress=llm.progress,
                        quantization=cfg.quantization)
    check_same_tokenizer(llm, draft, cfg.model)
    return DraftModelProposer(draft.model)


def check_same_tokenizer(llm: "LLM", draft: Any, name: str) -> None:
    """A draft must speak the target's token ids: same vocabulary, same token strings."""
    t, d = llm.tokenizer.hf, draft.tokenizer.hf
    if (llm.target.config.vocab_size != draft.config.vocab_size or len(t) != len(d)
            or t.get_vocab() != d.get_vocab()):
        raise SpecdecError(f"draft model '{name}' does not share the target's tokenizer "
                           f"({len(d)} vs {len(t)} tokens, embedding rows {draft.config.vocab_size} vs "
                           f"{llm.target.config.vocab_size}): use a draft of the same model family")


def methods() -> dict[str, Callable[[SpeculativeConfig, "LLM"], Proposer]]:
    return {"draft_model": _draft_model}


def parse_config(config: dict | SpeculativeConfig) -> SpeculativeConfig:
    if isinstance(config, SpeculativeConfig):
        return config
    if not isinstance(config, dict):
        raise SpecdecError("speculative_config must be a dict like {'method': 'draft_model', 'model': ..., "
                           "'num_speculative_tokens': 5}")
    d = dict(config)
    method = d.pop("method", None) or ("draft_model" if d.get("model") else None)
    if method is None:
        raise SpecdecError(f"speculative_config needs a 'method' (one of {', '.join(methods())})")
    k = d.pop("num_speculative_tokens", 5)
    model = d.pop("model", None)
    quantization = d.pop("quantization", None)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
        raise SpecdecError(f"num_speculative_tokens must be an integer from 1 to 32, got {k!r}")
    return SpeculativeConfig(method=method, model=model, num_speculative_tokens=k, quantization=quantization,
                             options=d)


def make_proposer(config: dict | SpeculativeConfig, llm: "LLM") -> tuple[Proposer, int]:
    cfg = parse_config(config)
    factory = methods().get(cfg.method)
    if factory is None:
        raise SpecdecError(f"unknown speculative method {cfg.method!r}: use one of {', '.join(methods())}")
    if cfg.options and cfg.method == "draft_model":
        raise SpecdecError(f"unknown speculative_config keys for 'draft_model': {', '.join(sorted(cfg.options))}")
    return factory(cfg, llm), cfg.num_speculative_tokens
