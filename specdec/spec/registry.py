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
    from specdec.spec.draft_model import DraftModelProposer  # noqa: PLC0415
    if not cfg.model:
        raise SpecdecError("method 'draft_model' needs a draft model: set speculative_config['model'] "
                           "(CLI: --speculative-model NAME_OR_PATH)")
    opts = dict(cfg.options)
    threshold = opts.pop("draft_confidence_threshold", 0.0)
    context = opts.pop("draft_context", None)
    if opts:
        raise SpecdecError(f"unknown speculative_config keys for 'draft_model': {', '.join(sorted(opts))} "
                           "(it takes model, quantization, num_speculative_tokens, adaptive, "
                           "draft_confidence_threshold, draft_context)")
    if not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0:
        raise SpecdecError(f"draft_confidence_threshold must be in [0, 1), got {threshold!r}")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise SpecdecError(f"draft_context must be a positive number of tokens, got {context!r}")
    return DraftModelProposer(load_draft(cfg, llm), float(threshold), context)


def load_draft(cfg: SpeculativeConfig, llm: "LLM"):
    """The draft model of a 'draft_model' stage, checked to share the target's tokenizer."""
    from specdec.llm import LoadedModel  # noqa: PLC0415
    if not cfg.model:
        raise SpecdecError("a 'draft_model' stage needs a draft model: set its 'model' "
                           "(CLI: --speculative-model NAME_OR_PATH)")
    draft = LoadedModel(cfg.model, llm.dtype, llm.device, progress=llm.progress, quantization=cfg.quantization)
    check_same_tokenizer(llm, draft, cfg.model)
    return draft.model


def check_same_tokenizer(llm: "LLM", draft: Any, name: str) -> None:
    """A draft must speak the target's token ids: same vocabulary, same token strings."""
    t, d = llm.tokenizer.hf, draft.tokenizer.hf
    if (llm.target.config.vocab_size != draft.config.vocab_size or len(t) != len(d)
            or t.get_vocab() != d.get_vocab()):
        raise SpecdecError(f"draft model '{name}' does not share the target's tokenizer "
                           f"({len(d)} vs {len(t)} tokens, embedding rows {draft.config.vocab_size} vs "
                           f"{llm.target.config.vocab_size}): use a draft of the same model family")


def _ngram(cfg: SpeculativeConfig, llm: "LLM") -> Proposer:
    from specdec.spec.ngram import NgramProposer  # noqa: PLC0415
    opts = dict(cfg.options)
    lo, hi = opts.pop("prompt_lookup_min", 1), opts.pop("prompt_lookup_max", 4)
    if opts:
        raise SpecdecError(f"unknown speculative_config keys for 'ngram': {', '.join(sorted(opts))} "
                           "(it takes prompt_lookup_min, prompt_lookup_max, num_speculative_tokens)")
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
        raise SpecdecError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo} and {hi}")
    return NgramProposer(lo, hi)


def _layer_skip(cfg: SpeculativeConfig, llm: "LLM") -> Proposer:
    from specdec.spec.layer_skip import LayerSkipProposer  # noqa: PLC0415
    opts = dict(cfg.options)
    # a quantized self-draft (measured best on the CPU: BENCHMARKS.md) runs every layer, no search
    ratio = opts.pop("skip_ratio", None)
    ratio = (0.0 if cfg.quantization else 0.45) if ratio is None else ratio
    threshold = opts.pop("draft_confidence_threshold", 0.6)
    search_steps = opts.pop("search_steps", 0 if cfg.quantization else 64)
    layers = opts.pop("skip_layers", None)
    if opts:
        raise SpecdecError(f"unknown speculative_config keys for 'layer_skip': {', '.join(sorted(opts))} "
                           "(it takes quantization, skip_ratio, skip_layers, search_steps, "
                           "draft_confidence_threshold)")
    n = llm.target.config.num_hidden_layers
    if n < 3:
        raise SpecdecError(f"layer_skip needs a model with at least 3 layers (this one has {n}): use draft_model or ngram")
    number = isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
    if cfg.quantization:  # a quantized self-draft may run every layer
        if not (number and 0.0 <= ratio < 1.0):
            raise SpecdecError(f"skip_ratio must be in [0, 1), got {ratio!r}")
    elif not (number and 0.0 < ratio < 1.0):
        raise SpecdecError(f"skip_ratio must be in (0, 1), got {ratio!r}")
    if not isinstance(threshold, (int, float)) or not 0.0 <= threshold < 1.0:
        raise SpecdecError(f"draft_confidence_threshold must be in [0, 1), got {threshold!r}")
    if not isinstance(search_steps, int) or search_steps < 0:
        raise SpecdecError(f"search_steps must be a non-negative integer, got {search_steps!r}")
    if layers is not None:
        if (not isinstance(layers, (list, tuple)) or not layers
                or not all(isinstance(i, int) and 0 <= i < n for i in layers) or len(set(layers)) >= n):
            raise SpecdecError(f"skip_layers must be a non-empty list of layer indices in 0..{n - 1}, "
                               "leaving at least one layer to run")
        layers = frozenset(layers)
    drafter = quantized_self(llm, cfg.quantization) if cfg.quantization else None
    return LayerSkipProposer(llm.target.model, llm.runner, float(ratio), float(threshold), search_steps, layers,
                             drafter=drafter)


def quantized_self(llm: "LLM", quantization: str):
    """The target's own weights loaded again at ``quantization`` bits, sharing its embedding table
    (a self-draft: no second model, no training). Loaded once per LLM and quantization: layer_skip
    and a cascade's self-draft stage share it."""
    from specdec.llm import LoadedModel  # noqa: PLC0415
    made = llm._self_drafts
    if quantization not in made:
        copy = LoadedModel(llm.target.name, llm.dtype, llm.device, progress=llm.progress, quantization=quantization)
        copy.model.embed_tokens = llm.target.model.embed_tokens
        made[quantization] = copy.model
    return made[quantization]


def _cascade(cfg: SpeculativeConfig, llm: "LLM") -> Proposer:
    from specdec.runtime.runner import ModelRunner  # noqa: PLC0415
    from specdec.spec.cascade import CascadeProposer  # noqa: PLC0415
    opts = dict(cfg.options)
    stages = opts.pop("stages", None)
    if opts:
        raise SpecdecError(f"unknown speculative_config keys for 'cascade': {', '.join(sorted(opts))} "
                           "(it takes stages and num_speculative_tokens)")
    if not isinstance(stages, list) or len(stages) != 2:
        raise SpecdecError("a cascade needs 'stages': [cheap proposer, drafter], cheapest first, e.g. "
                           "[{'method': 'ngram'}, {'method': 'draft_model', 'model': 'qwen2.5-coder-0.5b'}]")
    inner, last = (parse_config(st) for st in stages)
    self_draft = last.method == "layer_skip" and last.quantization is not None
    if inner.method != "ngram" or not (last.method == "draft_model" or self_draft):
        raise SpecdecError("cascade stages must be an 'ngram' stage followed by a 'draft_model' stage or a "
                           "quantized self-draft {'method': 'layer_skip', 'quantization': 'int4'}, got "
                           f"{inner.method!r} then {last.method!r}"
                           + (" without quantization" if last.method == "layer_skip" else ""))
    if last.options:
        raise SpecdecError(f"unknown keys for the cascade's {last.method} stage: {', '.join(sorted(last.options))}"
                           + (" (its self-draft runs every layer)" if self_draft else ""))
    adaptive = cfg.adaptive or inner.adaptive  # the n-gram stage adapts too (its K, its pauses)
    if self_draft:
        return CascadeProposer(ModelRunner(quantized_self(llm, last.quantization)), _ngram(inner, llm),
                               inner.num_speculative_tokens, shared=llm.runner, adaptive=adaptive)
    drafter = ModelRunner(load_draft(last, llm))
    return CascadeProposer(drafter, _ngram(inner, llm), inner.num_speculative_tokens, adaptive=adaptive)


def methods() -> dict[str, Callable[[SpeculativeConfig, "LLM"], Proposer]]:
    return {"draft_model": _draft_model, "ngram": _ngram, "layer_skip": _layer_skip, "cascade": _cascade}


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
    adaptive = d.pop("adaptive", False)
    if not isinstance(adaptive, bool):
        raise SpecdecError(f"adaptive must be true or false, got {adaptive!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
        raise SpecdecError(f"num_speculative_tokens must be an integer from 1 to 32, got {k!r}")
    return SpeculativeConfig(method=method, model=model, num_speculative_tokens=k, quantization=quantization,
                             adaptive=adaptive, options=d)


def make_proposer(config: dict | SpeculativeConfig, llm: "LLM") -> tuple[Proposer, SpeculativeConfig]:
    cfg = parse_config(config)
    factory = methods().get(cfg.method)
    if factory is None:
        raise SpecdecError(f"unknown speculative method {cfg.method!r}: use one of {', '.join(methods())}")
    if cfg.method != "draft_model" and cfg.model:
        raise SpecdecError(f"method {cfg.method!r} takes no draft model: drop 'model'")
    if cfg.method not in ("draft_model", "layer_skip") and cfg.quantization:
        raise SpecdecError(f"method {cfg.method!r} takes no 'quantization' (a draft model's or layer_skip's "
                           "self-draft's): drop it")
    return factory(cfg, llm), cfg
