"""``LLM``: the offline API, shaped like vLLM's.

    from specdec import LLM, SamplingParams
    llm = LLM(model="qwen2.5-coder-1.5b", dtype="bfloat16", device="cpu")
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.0, max_tokens=64, seed=0))
    llm = LLM(config="specdec-config.json")  # a deployment config written by `specdec tune` (deploy.py)
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence as Seq
from typing import TYPE_CHECKING

import torch

from specdec.config import SamplingParams
from specdec.deploy import DeploymentConfig, resolve as resolve_deployment
from specdec.engine import budget
from specdec.engine.core import EngineCore, RequestFailed
from specdec.engine.policies import make_policy
from specdec.errors import SpecdecError
from specdec.metrics import sequence_metrics
from specdec.formats.loader import LoadedModel, ModelStore, model_quantization, parse_device, parse_dtype
from specdec.formats.tokenizer import IncrementalDetokenizer
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.proposers.base import Proposer
from specdec.proposers.grammar import GrammarForced
from specdec.proposers.options import SpecOptions, TreeBudgetOptions
from specdec.runtime.kv_cache import blocks_for, memory_bytes
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence

if TYPE_CHECKING:
    from specdec.sampling.grammar import GrammarCompiler

# a string, token ids, or vLLM's dict forms: TextPrompt {"prompt": str}, TokensPrompt {"prompt_token_ids": ids}
Prompt = str | list[int] | dict
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Generate text with a Llama-family model, optionally with speculative decoding."""

    def __init__(self, model: str | None = None, dtype: str | torch.dtype | None = None, device: str = "cpu", *,
                 config: str | os.PathLike | DeploymentConfig | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 16, seed: int = 0,
                 speculative_config: dict | None = None, quantization: str | None = None,
                 progress: bool = True, enable_prefix_caching: bool = True,
                 kv_cache_memory: str | float | None = None) -> None:
        """``config``: a deployment config (``specdec/deploy.py``, a file or directory written by
        `specdec tune`) supplying model, dtype, quantization, speculative_config, spec_max_batch and
        max_prefill_tokens; an argument given here wins over its value. Without one: ``model`` is
        required and ``dtype`` defaults to bfloat16.

        A GGUF file or a registry name (a GGUF file underneath) runs the file's own quantized blocks on a CPU
        (``quantization="gguf"``, read in place) unless ``dtype`` or another ``quantization`` is given: e.g.
        ``dtype="bfloat16"`` runs its blocks dequantized. Draft models given by name follow the same rule."""
        self.deployment = resolve_deployment(config)
        cfg = self.deployment
        model = model if model is not None else cfg.model
        if not model:
            raise SpecdecError("LLM needs a model: give model=... or a config that names one")
        dtype_given = dtype is not None or cfg.dtype is not None
        dtype = dtype if dtype is not None else cfg.dtype or "bfloat16"
        quantization = quantization if quantization is not None else cfg.quantization
        if speculative_config is None:
            speculative_config = cfg.speculative_config
        # the engine's defaults (engine() arguments override them): drafting off above this batch
        # size (None: no cap), chunked prefill budget per step (None: whole prompts)
        self.spec_max_batch: int | None = cfg.spec_max_batch
        self.max_prefill_tokens: int | None = cfg.max_prefill_tokens
        # with streams decoding, a step with prompt tokens takes at most this times one without (engine.pacing)
        self.prefill_slowdown: float | None = None
        self.dtype, self.device = parse_dtype(dtype), parse_device(device)
        self.progress = progress
        quantization = model_quantization(model, quantization, dtype_given, self.device)
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
        # prompts skip the prefill of cached prefixes (a hybrid model caches none: its HybridCache keeps no
        # states for a prefix's end, it only shares a prompt in flight with its twin)
        self.hybrid = bool(self.target.config.layer_mixers)
        self.enable_prefix_caching = enable_prefix_caching
        # the target's KV pool: the budget (bytes, or a fraction of the machine's memory; each drafter's
        # cache holds as many blocks), at most what every row's whole context takes
        try:
            budget_bytes = memory_bytes(kv_cache_memory)
        except ValueError as e:
            raise SpecdecError(str(e)) from e
        # a hybrid model's recurrent states: a fixed size per sequence (rings of K + 4 entries at most), taken from the
        # budget first
        if self.hybrid and speculative_config:
            from specdec.proposers.registry import parse_config  # noqa: PLC0415 (optional part)
            self.target.model.fit_state_slots(parse_config(speculative_config).num_speculative_tokens + 1)
        # and the windowed layers' keys (a window's worth per sequence, KVCache.local) are taken so too
        model = self.target.model
        states = max_num_seqs * (model.state_bytes() + model.window_bytes(self.max_model_len + 64))
        if states and states >= budget_bytes:
            raise SpecdecError(f"kv_cache_memory {kv_cache_memory!r} does not hold the recurrent states or windowed "
                               f"keys of max_num_seqs={max_num_seqs} sequences ({states} bytes): raise it or lower "
                               "max_num_seqs")
        most = max_num_seqs * blocks_for(self.max_model_len + 64) + 1
        # every layer windowed (Mistral): the blocks of the other layers cost nothing, the pool only counts positions
        num_blocks = min((budget_bytes - states) // model.block_bytes(), most) if model.block_bytes() else most
        if num_blocks < 2:
            raise SpecdecError(f"kv_cache_memory {kv_cache_memory!r} holds no KV cache block of this model "
                               f"({self.target.model.block_bytes()} bytes)")
        self.runner = ModelRunner(self.target.model, num_blocks=num_blocks)
        self.models = ModelStore(self.target, self.runner, progress=progress, dtype_given=dtype_given)
        self.proposer: Proposer | None = None
        self.speculative: SpecOptions | None = None  # the validated speculative config (None: plain)
        self._proposers: dict[str, tuple[Proposer, SpecOptions]] = {}
        # batch size (or (batch size, K, context) for CostAwareK) -> verification seconds per T, measured once
        self._costs: dict[int | tuple[int, int], dict[int, float]] = {}
        # CostAwareK's record: one per proposer (its config's repr: method and options) and K
        self._draft_records: dict[tuple[str, int], budget.DraftRecord] = {}
        self.set_speculative_config(speculative_config)
        self._rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None

    def set_speculative_config(self, config: dict | SpecOptions | None, reload: bool = False) -> None:
        """Switch speculation to another method or setting (None: off) without reloading the target.

        Proposers already built for an identical config are reused (a draft model loads once), unless
        ``reload``: then it is built afresh (a head rewritten under the same path, as training does). An MoE
        target's draft-length record (``engine.budget.DraftRecord``) is kept per config and K: a method
        switched to starts from its own, never from another's acceptance and probe gap (a reload: afresh).
        """
        if not config:
            self.proposer, self.speculative = None, None
            return
        from specdec.proposers.registry import make_proposer, parse_config  # noqa: PLC0415 (optional part)
        opts = parse_config(config)
        if self.hybrid and opts.drafts_trees:
            raise SpecdecError(f"{self.target.config.architecture} is a hybrid model: its recurrent states follow one "
                               f"chain of tokens, so it verifies chains of drafts, not token trees ({opts.method!r} "
                               "as configured drafts trees: no tree_topk, no medusa, no suffix)")
        key = repr(opts)
        if key not in self._proposers or reload:
            self._proposers[key] = make_proposer(opts, self.models)
        if reload:  # new weights under the same config: the old drafts' record says nothing of the new ones'
            self._draft_records = {r: v for r, v in self._draft_records.items() if r[0] != key}
        self.proposer, self.speculative = self._proposers[key]

    def reset_runtime(self) -> None:
        """Start over from the loaded weights: a fresh runner (an empty KV cache and block pool, the same
        budget and prefill chunk) and a fresh proposer of the same config (its own caches and state;
        draft models are not loaded again). A server restarting a failed engine calls this, so a
        corrupted cache, pool or proposer does not survive the restart. Engine cores made before keep
        the old objects: drop them first."""
        old = self.runner
        self.runner = ModelRunner(self.target.model, prefill_chunk=old.prefill_chunk, num_blocks=old.num_blocks)
        self.models.runner = self.runner  # proposers sharing the target's runner (layer_skip) take the new one
        speculative, self.proposer, self.speculative = self.speculative, None, None
        self._proposers.clear()
        self.set_speculative_config(speculative)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    @property
    def adaptive(self) -> bool:
        return self.speculative is not None and self.speculative.adaptive

    @property
    def speculative_method(self) -> str | None:
        """The configured method's name (None: plain decoding)."""
        return self.speculative.method if self.speculative is not None else None

    def engine(self, num_speculative_tokens: int | None = None, spec_max_batch: int | None = None,
               max_num_seqs: int | None = None, rows_budget: int = 16,
               max_prefill_tokens: int | None = None, prefill_slowdown: float | None = None) -> EngineCore:
        """An engine core over this model and its proposer (``num_speculative_tokens`` 0: plain;
        ``spec_max_batch``: no drafts while more sequences run, and K capped at
        ``rows_budget // B - 1``; ``max_prefill_tokens``: chunked prefill, at most that many prompt
        tokens per step; ``prefill_slowdown``: fewer while others decode, so that a step with prompt
        tokens takes at most that times one without, see ``engine.pacing``). ``spec_max_batch`` /
        ``max_prefill_tokens`` / ``prefill_slowdown`` None: this LLM's own (its deployment config's; None
        without one)."""
        if spec_max_batch is None:
            spec_max_batch = self.spec_max_batch
        if max_prefill_tokens is None:
            max_prefill_tokens = self.max_prefill_tokens
        if prefill_slowdown is None:
            prefill_slowdown = self.prefill_slowdown
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if k < 0 or (k > 0 and self.proposer is None):
            raise SpecdecError(f"num_speculative_tokens={k} needs a speculative_config" if k > 0
                               else f"num_speculative_tokens must be >= 0, got {k}")
        policy = make_policy(k, self.adaptive, spec_max_batch, rows_budget)
        if isinstance(self.speculative, TreeBudgetOptions) and self.speculative.tree_budget == "auto":
            policy = budget.MeasuredBudget(policy, self._verify_costs)
        if k > 0 and self.speculative.cost_aware:  # K from what a block costs at this batch size and context
            policy = budget.CostAwareK(policy, lambda b, context=0, k=k: self._verify_costs(b, k, context),
                                       record=self._draft_records.setdefault((repr(self.speculative), k),
                                                                             budget.DraftRecord()))
        proposer = self.proposer if k > 0 else None
        # a hybrid's state rings hold a whole verification block and what the next one reads before it; a
        # hybrid drafter's hold its draft (this call's K may exceed the configured one)
        self.target.model.fit_state_slots(k + 1, self.runner.cache)
        if proposer is not None:
            proposer.fit_draft_length(k)
        if proposer is not None and self.speculative.grammar_draft and not isinstance(proposer, GrammarForced):
            proposer = GrammarForced(proposer)  # constrained rows draft their grammar's forced tokens
        return EngineCore(self.runner, proposer, policy,
                          max_num_seqs=max_num_seqs or self.max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                          prefix_caching=self.enable_prefix_caching, prefill_slowdown=prefill_slowdown)

    def _verify_costs(self, batch_size: int, k: int | None = None, context: int = 0) -> dict[int, float]:
        """The target's verification cost per T tokens at ``batch_size`` rows, measured once (``engine.budget``).
        With ``k`` (``CostAwareK``): only T = 1 .. k + 1, the blocks that policy may choose, each timed twice
        after a warm-up (a batch of 16 at K = 4 is five forwards of up to 80 rows, not the tree budget's
        512); after ``context`` slots of each row (a context bucket's: at 16k, one scratch row of 16k slots)
        only T = 1 and k + 1: what the context adds to a block is its rows' attention over it, linear in T
        (``CostAwareK.costs_at`` interpolates), and each forward there is a long one (the 1.5B at a 2k bucket,
        K = 4: 0.95 s of the first long request's first token for T = 1 .. 5, Xeon AMX)."""
        key = batch_size if k is None else (batch_size, k, context)
        if key not in self._costs:
            sizes = (1, k + 1) if context else tuple(range(1, k + 2)) if k is not None else None
            self._costs[key] = (budget.verify_costs(self.target.model, batch_size) if k is None else
                                budget.verify_costs(self.target.model, batch_size, sizes, repeats=2, context=context))
        return self._costs[key]

    # ---- requests -------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            text, ids = _prompt_dict(prompt)
            if ids is None:
                ids = self.tokenizer.encode(text)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif _is_ids(prompt):
            ids, text = list(prompt), None
        else:
            raise SpecdecError("a prompt must be a string, a list of token ids, {'prompt': text} or "
                               "{'prompt_token_ids': ids}")
        bad = [t for t in ids if not 0 <= t < self.target.config.vocab_size]
        if bad:
            raise SpecdecError(f"prompt token id {bad[0]} is outside the vocabulary "
                               f"(0..{self.target.config.vocab_size - 1})")
        if not ids:
            raise SpecdecError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise SpecdecError(f"the prompt has {len(ids)} tokens but the model's context is "
                               f"{self.max_model_len} tokens: shorten the prompt")
        return text, ids

    def make_sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        """A request's sequence: the prompt checked and tokenized, its seed drawn when none is given."""
        text, ids = self._tokenize(prompt)
        vocab = self.target.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise SpecdecError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                               f"(0..{vocab - 1})")
        matcher = self.grammars.matcher(params.structured_output) if params.structured_output is not None else None
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        return Sequence(request_id=str(next(self._ids)), prompt=text, prompt_ids=ids, params=params,
                        detokenizer=IncrementalDetokenizer(self.tokenizer),
                        eos_ids=frozenset(self.tokenizer.eos_token_ids), max_len=self.max_model_len,
                        seed=seed, matcher=matcher)

    @property
    def grammars(self) -> "GrammarCompiler":
        """The structured-output compiler of this model's tokenizer (built on first use, ~1 s)."""
        if self._grammars is None:
            from specdec.sampling.grammar import GrammarCompiler  # noqa: PLC0415 (loads the grammar engine)
            self._grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size)
        return self._grammars

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
        core = self.engine(num_speculative_tokens)
        core.reserve(len(seqs), max(core.slots_needed(s) for s in seqs))
        self.last_engine = core
        for s in seqs:
            core.add(s)
        while core.has_work():
            result = core.step()
            if on_step is not None:
                on_step(result.stepped)
            if result.failed:  # a request's own error ends the run, as it always has, once published
                seq, err = result.failed[0]
                raise RequestFailed(seq, err) from err
            if result.error is not None:
                raise result.error

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_step: Callable[[list[Sequence]], None] | None = None,
                 num_speculative_tokens: int | None = None) -> list[RequestOutput]:
        """Generate a completion for each prompt: a string, a list of token ids, or vLLM's dicts
        ``{"prompt": text}`` (TextPrompt) and ``{"prompt_token_ids": ids}`` (TokensPrompt, optionally with
        its ``"prompt"`` text); one prompt or a list of them, forms mixed.

        ``num_speculative_tokens`` overrides the configured draft length (0: plain decoding).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(len(prompts), sampling_params)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        self.run(seqs, on_step, num_speculative_tokens)
        return [self._output(s) for s in seqs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             on_step: Callable[[list[Sequence]], None] | None = None,
             num_speculative_tokens: int | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        ``tools``: OpenAI-style function definitions the template shows the model; its replies'
        calls parse with ``specdec.server.tools.parse_tool_calls``. ``chat_template_kwargs``: the
        template's switches, e.g. ``{"enable_thinking": False}`` (Qwen3)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        for conv in convs:
            if not isinstance(conv, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in conv):
                raise SpecdecError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        return self.generate([self.tokenizer.apply_chat_template(c, tools, chat_template_kwargs) for c in convs],
                             sampling_params, on_step,
                             num_speculative_tokens)

    def _output(self, s: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=s.request_id, prompt=s.prompt, prompt_token_ids=s.prompt_ids,
            outputs=[CompletionOutput(0, s.text, list(s.output_ids), s.finish_reason, s.stop_reason,
                                      None if s.params.logprobs is None else list(s.output_logprobs))],
            finished=s.finished, metrics=sequence_metrics(s),
            prompt_logprobs=None if s.params.prompt_logprobs is None else [None] + list(s.prompt_logprobs))


def _is_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_dict(prompt: dict) -> tuple[str | None, list[int] | None]:
    """A vLLM prompt dict's text and token ids (None: tokenize the text): ``{"prompt_token_ids": ids}``
    (with an optional ``"prompt"``, the text they spell, carried to the output) or ``{"prompt": text}``."""
    unknown = sorted(set(map(str, prompt)) - set(PROMPT_KEYS))
    if unknown or not set(prompt) & set(PROMPT_KEYS):
        extra = f" (specdec takes no {', '.join(map(repr, unknown))})" if unknown else ""
        raise SpecdecError("a prompt dict takes 'prompt' (its text) or 'prompt_token_ids' (its token ids), "
                           f"got keys {sorted(map(str, prompt))}{extra}")
    text = prompt.get("prompt")
    if "prompt" in prompt and not isinstance(text, str):
        raise SpecdecError(f"a prompt dict's 'prompt' must be a string, got {text!r}")
    if "prompt_token_ids" not in prompt:
        return text, None
    ids = prompt["prompt_token_ids"]
    if not _is_ids(ids):
        raise SpecdecError(f"a prompt dict's 'prompt_token_ids' must be a list of token ids, got {ids!r}")
    return text, list(ids)
