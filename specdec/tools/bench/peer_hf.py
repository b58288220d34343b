"""The transformers peer: its own ``generate()`` on the same converted model directories and prompts.

    plain        model.generate(ids, do_sample=False)                            the peer's baseline
    draft_model  model.generate(ids, assistant_model=draft)                      K tokens per step, fixed
    ngram        model.generate(ids, prompt_lookup_num_tokens=K, max_matching_ngram_size=...)

The assistant's draft length lives in its own ``generation_config`` (that is where transformers
reads it): we pin it to K with the "constant" schedule and no confidence cut-off, so the peer drafts
what our configuration drafts (an ``adaptive`` config maps to transformers' "heuristic_transient").
The peer's draft is always unquantized (``--dtype``). Mean accepted length for the peer is generated
tokens per target forward, counted by a forward hook held only for the duration of one call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.proposers.registry import config_method

PEER_METHODS = ("draft_model", "ngram")


@dataclass
class PeerOutput:
    token_ids: list[int]
    seconds: float
    num_target_forwards: int

    @property
    def mean_accepted_length(self) -> float:
        return len(self.token_ids) / self.num_target_forwards if self.num_target_forwards else 0.0


def _load(name: str, dtype: torch.dtype, device: torch.device, eos_ids: list[int], pad_id: int):
    import transformers  # noqa: PLC0415
    from specdec.formats.hub import resolve_model  # noqa: PLC0415
    path = resolve_model(name, progress=False)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SpecdecError(f"transformers could not load {name} from {path} ({' '.join(str(e).split())[:200]}): "
                           "drop --peer hf or convert the model again") from e
    finally:
        transformers.logging.set_verbosity(verbosity)
    model.to(device).eval()
    # a fresh generation config: the directory's own (sampling defaults, repetition penalty) must not leak in
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id)
    return model


def peer_reason(spec: dict | None) -> str | None:
    """Why transformers has no counterpart of this configuration (None: it has one)."""
    if spec is None:
        return None
    method = config_method(spec)
    if method not in PEER_METHODS:
        return f"transformers has no counterpart of method {method!r} (peer runs {', '.join(PEER_METHODS)})"
    return None


class HFPeer:
    """transformers' plain and assisted generation with the target (and drafts) loaded in ``dtype``."""

    def __init__(self, model: str, dtype: torch.dtype, device: torch.device, eos_ids: list[int],
                 pad_id: int) -> None:
        self.dtype, self.device = dtype, device
        self.eos_ids, self.pad_id = sorted(eos_ids), pad_id
        self.model = _load(model, dtype, device, self.eos_ids, pad_id)
        self._drafts: dict[str, object] = {}

    def draft(self, name: str):
        if name not in self._drafts:
            self._drafts[name] = _load(name, self.dtype, self.device, self.eos_ids, self.pad_id)
        return self._drafts[name]

    def _kwargs(self, spec: dict | None, k: int | None) -> dict:
        if spec is None:
            return {}
        reason = peer_reason(spec)
        if reason:
            raise SpecdecError(reason)
        k = int(k if k is not None else spec.get("num_speculative_tokens", 5))
        if config_method(spec) == "ngram":
            return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": int(spec.get("prompt_lookup_max", 4))}
        draft = self.draft(spec["model"])
        gc = draft.generation_config
        gc.num_assistant_tokens = k
        gc.num_assistant_tokens_schedule = "heuristic_transient" if spec.get("adaptive") else "constant"
        gc.assistant_confidence_threshold = 0.0
        return {"assistant_model": draft}

    def generate(self, prompt_ids: list[int], spec: dict | None, k: int | None,
                 params: SamplingParams) -> PeerOutput:
        """One request, timed around ``model.generate`` (prefill included, as for our engine)."""
        kwargs = self._kwargs(spec, k)
        ids = torch.tensor([prompt_ids], device=self.device)  # (1, L)
        if params.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs |= {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                       "top_k": params.top_k if params.top_k > 0 else None}
            torch.manual_seed(params.seed if params.seed is not None else 0)
        calls = [0]

        def count(*_: object) -> None:
            calls[0] += 1

        import transformers  # noqa: PLC0415
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # assisted generation warns about its own internal calls
        hook = self.model.register_forward_pre_hook(count)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                          min_new_tokens=params.max_tokens if params.ignore_eos else None,
                                          eos_token_id=self.eos_ids, pad_token_id=self.pad_id, **kwargs)
            seconds = time.perf_counter() - t0
        finally:
            hook.remove()
            transformers.logging.set_verbosity(verbosity)
        return PeerOutput(out[0, ids.shape[1]:].tolist(), seconds, calls[0])
