"""Results of ``LLM.generate``: shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec.sampling.logprobs import TokenLogprob


@dataclass
class RequestMetrics:
    """Timing and speculation statistics of one request (or of a whole run, when aggregated)."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefill_seconds: float = 0.0  # until the first generated token (time to first token)
    decode_seconds: float = 0.0  # after the first generated token
    tokens_per_second: float = 0.0  # generated tokens / (prefill + decode)
    decode_tokens_per_second: float = 0.0  # tokens after the first / decode_seconds
    num_steps: int = 0  # target forwards after prefill (verification steps)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    mean_accepted_length: float = 0.0  # tokens emitted per target step, bonus included
    acceptance_by_position: list[float] = field(default_factory=list)  # accepted / drafted at draft slot i
    num_drafted_by_position: list[int] = field(default_factory=list)
    num_accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    other_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop string), "length" (max_tokens or context)
    stop_reason: str | int | None = None  # the stop string or EOS token id that ended it
    logprobs: list[TokenLogprob] | None = None  # per token (SamplingParams.logprobs): raw model logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: None for the first prompt token (no context), then one per token
    prompt_logprobs: list[TokenLogprob | None] | None = None
