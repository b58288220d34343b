"""Frozen configuration dataclasses shared by every part of specdec."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from specdec.errors import SpecdecError

# weight quantizations a model loads with (the target's --quantization, a draft's, a self-draft's):
# int4 / int8 from the bf16 weights, gguf: a GGUF file's own blocks (models/quant.py)
QUANTIZATIONS = ("int4", "int8", "gguf")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family model (Llama 2/3, Qwen2/2.5, SmolLM, Mistral)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3-style frequency scaling, when present
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary."""
        arch = (d.get("model_type") or "llama").lower()
        if arch not in ("llama", "qwen2", "mistral", "smollm", "smollm2"):
            raise SpecdecError(
                f"unsupported model_type {arch!r}: specdec runs Llama-family models "
                "(llama, qwen2, mistral)")
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_theta = d.get("rope_theta")
        if rope_theta is None:  # transformers 5 moved it under rope_parameters
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        rope_scaling = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        rope_scaling.pop("rope_theta", None)
        if rope_scaling.get("rope_type", rope_scaling.get("type")) in ("default", None):
            rope_scaling = None
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            architecture=arch,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    def to_hf(self) -> dict[str, Any]:
        """The matching Hugging Face ``config.json`` dictionary (loadable by transformers)."""
        arch = self.architecture
        hf_arch = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(arch, "LlamaForCausalLM")
        d: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if arch != "qwen2":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if arch == "mistral":
            d["sliding_window"] = None
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (named as in vLLM).

    temperature == 0 means greedy; so does a temperature below ``GREEDY_BELOW`` (1e-5), as in vLLM:
    dividing logits by so small a number overflows, so such a request is stored with temperature 0.
    top_k <= 0 (or -1) disables top-k, top_p == 1 disables top-p, min_p == 0 disables min-p.
    ``seed`` is an integer in [0, 2**64) (what a torch.Generator takes); None draws one.
    """

    GREEDY_BELOW: ClassVar[float] = 1e-5
    SEED_LIMIT: ClassVar[int] = 2**64

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # penalties and bias (sampling/penalties.py): OpenAI's and vLLM's definitions, lossless under speculation
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # log-probabilities of the raw model (sampling/logprobs.py): None = not computed
    logprobs: int | None = None  # per generated token: its own and the top N alternatives, N in [0, 20]
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (a prompt-logprobs pass)
    # a constraint on the output (sampling/grammar.py): a StructuredOutput or its dict, e.g.
    # {"json": schema}, {"regex": "..."}, {"choice": [...]}, {"grammar": lark}, {"json_object": True}
    structured_output: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise SpecdecError(f"invalid sampling parameters: stop must be a string or a list of strings, "
                               f"got {self.stop!r}")
        problems = []
        if not _is_number(self.temperature) or not (0.0 <= self.temperature < math.inf):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        elif self.temperature < self.GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # vLLM's _SAMPLING_EPS: greedy
        if not all(_is_number(v) for v in (self.top_k, self.top_p, self.min_p, self.max_tokens)):
            raise SpecdecError("invalid sampling parameters: top_k, top_p, min_p and max_tokens must be numbers")
        if not _is_integral(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            problems.append(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not _is_integral(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if self.seed is not None and not (_is_integral(self.seed) and 0 <= self.seed < self.SEED_LIMIT):
            problems.append(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        elif self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append("stop must be a list of non-empty strings")
        problems += _penalty_problems(self)
        if self.structured_output is not None:
            from specdec.sampling.grammar import StructuredOutput  # noqa: PLC0415 (config stays import-light)
            try:
                object.__setattr__(self, "structured_output", StructuredOutput.from_dict(self.structured_output))
            except SpecdecError as e:
                problems.append(str(e))
        if problems:
            raise SpecdecError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Some penalty or a logit bias changes the logits (sampling/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def _is_number(x: Any) -> bool:
    """An int or float (bool excluded); NaN counts as a number here and fails the range checks."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_integral(x: Any) -> bool:
    """An int, or a float holding a whole number (3.0); not NaN, infinity or a bool."""
    return _is_number(x) and (isinstance(x, int) or x.is_integer())


MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's top_logprobs bound)


def _penalty_problems(p: SamplingParams) -> list[str]:
    """What is wrong with ``p``'s penalties, bias and logprobs (normalizes logit_bias keys to int)."""
    problems = []
    for name, v in (("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty)):
        if not _is_number(v) or not (-2.0 <= v <= 2.0):
            problems.append(f"{name} must be in [-2, 2], got {v!r}")
    if not _is_number(p.repetition_penalty) or not (0.0 < p.repetition_penalty < math.inf):
        problems.append(f"repetition_penalty must be a number > 0 (1 = off), got {p.repetition_penalty!r}")
    if p.logit_bias is not None:
        items = list(p.logit_bias.items()) if isinstance(p.logit_bias, dict) else [(None, None)]
        keys = [int(k) if isinstance(k, str) and k.strip().isdigit() else k for k, _ in items]
        if not all(_is_integral(k) and k >= 0 and _is_number(v) and -100.0 <= v <= 100.0
                   for k, (_, v) in zip(keys, items)):
            problems.append("logit_bias must map token ids (>= 0) to numbers in [-100, 100]")
        else:
            object.__setattr__(p, "logit_bias", {int(k): float(v) for k, (_, v) in zip(keys, items)} or None)
    for name, v in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if v is not None and not (_is_integral(v) and 0 <= v <= MAX_LOGPROBS):
            problems.append(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (top alternatives), got {v!r}")
    return problems
