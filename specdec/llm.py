"""``LLM``: the offline API, shaped like vLLM's.

    from specdec import LLM, SamplingParams
    llm = LLM(model="qwen2.5-coder-1.5b", dtype="bfloat16", device="cpu")
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.0, max_tokens=64, seed=0))
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence as Seq

import torch

from specdec.config import SamplingParams
from specdec.engine import Engine, sequence_metrics
from specdec.errors import SpecdecError
from specdec.models.linear import pack_linears
from specdec.models.llama import build_model
from specdec.models.quant import quantize_model
from specdec.models.loading import gguf_source, load_model_config, load_state_dict, resolve_model
from specdec.models.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.runtime.runner import ModelRunner
from specdec.runtime.sequence import Sequence
from specdec.spec.adaptive import AdaptiveK, FixedK

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}

Prompt = str | list[int]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}: use one of bfloat16, float16, float32")
    return DTYPES[dtype]


def parse_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise SpecdecError(f"invalid device {device!r}: use 'cpu' or 'cuda'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device 'cuda' requested but no CUDA GPU is available: use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise SpecdecError(f"unsupported device {device!r}: use 'cpu' or 'cuda'")
    return dev


class LoadedModel:
    """A model directory turned into a runnable model plus its tokenizer."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device, progress: bool = True,
                 quantization: str | None = None) -> None:
        t0 = time.perf_counter()
        self.name = name
        self.path = resolve_model(name, progress=progress)
        self.config = load_model_config(self.path)
        self.model = build_model(self.config, load_state_dict(self.path, dtype), dtype=dtype, device=device)
        if quantization:
            # linears the group size cannot split stay bf16
            src = gguf_source(name, progress=progress) if quantization == "gguf" else None
            quantize_model(self.model, quantization, src)
        self.packed = pack_linears(self.model) > 0  # bf16 on CPU: oneDNN-blocked weights
        self.tokenizer = Tokenizer(self.path)
        self.load_seconds = time.perf_counter() - t0


class LLM:
    """Generate text with a Llama-family model, optionally with speculative decoding."""

    def __init__(self, model: str, dtype: str | torch.dtype = "bfloat16", device: str = "cpu", *,
                 max_model_len: int | None = None, max_num_seqs: int = 16, seed: int = 0,
                 speculative_config: dict | None = None, quantization: str | None = None,
                 progress: bool = True) -> None:
        self.dtype, self.device = parse_dtype(dtype), parse_device(device)
        self.progress = progress
        self.target = LoadedModel(model, self.dtype, self.device, progress=progress, quantization=quantization)
        self.tokenizer = self.target.tokenizer
        limit = self.target.config.max_position_embeddings
        if max_model_len is not None and not (1 < max_model_len <= limit):
            raise SpecdecError(f"max_model_len must be between 2 and the model's context length {limit}, "
                               f"got {max_model_len}")
        self.max_model_len = max_model_len or limit
        if max_num_seqs < 1:
            raise SpecdecError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.runner = ModelRunner(self.target.model)
        self.proposer, self.num_speculative_tokens, self.adaptive = None, 0, False
        self._proposers: dict[str, tuple] = {}
        self._self_drafts: dict[str, torch.nn.Module] = {}  # quantization -> the target's quantized copy
        self.set_speculative_config(speculative_config)
        self._rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()

    def set_speculative_config(self, config: dict | None) -> None:
        """Switch speculation to another method or setting (None: off) without reloading the target.

        Proposers already built for an identical config are reused (a draft model loads once).
        """
        if not config:
            self.proposer, self.num_speculative_tokens, self.adaptive = None, 0, False
            return
        from specdec.spec.registry import make_proposer  # noqa: PLC0415 (optional part)
        key = repr(sorted(config.items())) if isinstance(config, dict) else repr(config)
        if key not in self._proposers:
            self._proposers[key] = make_proposer(config, self)
        self.proposer, cfg = self._proposers[key]
        self.num_speculative_tokens, self.adaptive = cfg.num_speculative_tokens, cfg.adaptive

    # ---- requests -------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < self.target.config.vocab_size]
            if bad:
                raise SpecdecError(f"prompt token id {bad[0]} is outside the vocabulary "
                                   f"(0..{self.target.config.vocab_size - 1})")
        else:
            raise SpecdecError("a prompt must be a string or a list of token ids")
        if not ids:
            raise SpecdecError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise SpecdecError(f"the prompt has {len(ids)} tokens but the model's context is "
                               f"{self.max_model_len} tokens: shorten the prompt")
        return text, ids

    def _sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        text, ids = self._tokenize(prompt)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        return Sequence(request_id=str(next(self._ids)), prompt=text, prompt_ids=ids, params=params,
                        detokenizer=IncrementalDetokenizer(self.tokenizer),
                        eos_ids=frozenset(self.tokenizer.eos_token_ids), max_len=self.max_model_len,
                        generator=torch.Generator(device=self.device).manual_seed(seed))

    def _params_list(self, n: int, sampling_params: SamplingParams | Seq[SamplingParams] | None
                     ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise SpecdecError(f"got {len(params)} sampling parameter sets for {n} prompts")
        return params

    # ---- running --------------------------------------------------------------------------
    def run(self, seqs: list[Sequence], on_step: Callable[[list[Sequence]], None] | None = None,
            num_speculative_tokens: int | None = None) -> None:
        """Run ``seqs`` to completion, at most ``max_num_seqs`` at a time; ``on_step`` sees each step.

        ``num_speculative_tokens`` overrides the configured draft length for this call (0: plain).
        """
        if not seqs:
            return
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if k < 0 or (k > 0 and self.proposer is None):
            raise SpecdecError(f"num_speculative_tokens={k} needs a speculative_config" if k > 0
                               else f"num_speculative_tokens must be >= 0, got {k}")
        proposer = self.proposer if k > 0 else None
        need = max(min(len(s.prompt_ids) + s.params.max_tokens, self.max_model_len) for s in seqs) + k + 1
        cache = self.runner.ensure_cache(min(len(seqs), self.max_num_seqs), need)
        if proposer is not None:
            proposer.prepare(cache.rows, cache.max_len)
        policy = AdaptiveK(k) if self.adaptive else FixedK(k)
        engine = Engine(self.runner, proposer, policy)
        self.last_engine = engine
        waiting = list(seqs)
        while waiting or engine.running:
            while waiting and len(engine.running) < self.max_num_seqs:
                engine.add(waiting.pop(0))
            stepped = engine.step()
            if on_step is not None:
                on_step(stepped)

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_step: Callable[[list[Sequence]], None] | None = None,
                 num_speculative_tokens: int | None = None) -> list[RequestOutput]:
        """Generate a completion for each prompt (a string or a list of token ids).

        ``num_speculative_tokens`` overrides the configured draft length (0: plain decoding).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(len(prompts), sampling_params)
        seqs = [self._sequence(p, sp) for p, sp in zip(prompts, params)]
        self.run(seqs, on_step, num_speculative_tokens)
        return [self._output(s) for s in seqs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             on_step: Callable[[list[Sequence]], None] | None = None,
             num_speculative_tokens: int | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        for conv in convs:
            if not isinstance(conv, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in conv):
                raise SpecdecError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        return self.generate([self.tokenizer.apply_chat_template(c) for c in convs], sampling_params, on_step,
                             num_speculative_tokens)

    def _output(self, s: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=s.request_id, prompt=s.prompt, prompt_token_ids=s.prompt_ids,
            outputs=[CompletionOutput(0, s.text, list(s.output_ids), s.finish_reason, s.stop_reason)],
            finished=s.finished, metrics=sequence_metrics(s))
