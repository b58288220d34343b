"""Frozen configuration dataclasses shared by every part of specdec."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from specdec.errors import SpecdecError

# weight quantizations a model loads with (the target's --quantization, a draft's, a self-draft's):
# int4 / int8 from the bf16 weights, gguf: a GGUF file's own blocks (quant/qlinear.py)
QUANTIZATIONS = ("int4", "int8", "gguf")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model: the Llama block plus its family's switches (specdec/families.py)."""

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
    # a family's differences from the Llama block (specdec/families.py; the math: models/llama.py)
    qk_norm: str = ""  # "head": RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3); "full": of all q, all k (OLMo 2)
    norm_placement: str = "pre"  # "pre" (Llama); "sandwich": also after attention and MLP (Gemma); "post": only after (OLMo 2)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # embeddings times it (Gemma: sqrt(hidden); Granite's embedding_multiplier)
    residual_scale: float = 1.0  # each block's attention and MLP outputs times it before the residual add (Granite)
    attn_scale: float | None = None  # attention scores' scale; None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    layer_windows: tuple[int, ...] | None = None  # per layer: a sliding window of that many positions, 0 = all keys
    rope_local_theta: float | None = None  # RoPE base of the windowed layers (Gemma 3); None: rope_theta
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dimensions of each head (Phi-3)
    rope_layers: tuple[int, ...] | None = None  # per layer: 1 = RoPE, 0 = none (SmolLM3's NoPE layers)
    attn_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    o_bias: bool = False  # a bias on the attention's output projection too (gpt-oss)
    # hybrid models (models/recurrent.py): per layer its token mixer, "attention" (None: every layer),
    # "conv" (LFM2's gated short convolution) or "delta" (Qwen3.5's gated delta-net)
    layer_mixers: tuple[str, ...] | None = None
    conv_kernel: int = 0  # the causal depthwise convolution's width (LFM2's conv_L_cache, Qwen3.5's 4)
    conv_bias: bool = False  # LFM2's in/out projections and convolution carry biases
    delta_k_heads: int = 0  # gated delta-net: query/key heads,
    delta_v_heads: int = 0  # value heads (a multiple of the key heads),
    delta_k_dim: int = 0  # and their sizes
    delta_v_dim: int = 0
    attn_output_gate: bool = False  # attention's output times sigmoid(a second half of q_proj) per head (Qwen3.5)
    # mixture of experts (models/moe.py); num_experts 0: every layer's MLP is dense
    num_experts: int = 0
    experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's
    router: str = "softmax"  # "softmax": softmax over all experts, then top-k; "topk_softmax": top-k logits, then softmax over them
    norm_topk_prob: bool = False  # "softmax": the k chosen probabilities renormalised to sum to 1 (Qwen3-MoE, Mixtral)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on each expert's products (gpt-oss)
    moe_layers: tuple[int, ...] | None = None  # per layer: 1 = experts, 0 = a dense MLP; None: all experts
    shared_expert_size: int = 0  # a dense expert every token also takes, gated by sigmoid(w . x) (Qwen2-MoE)
    swiglu_limit: float = 7.0  # activation "swiglu_oai" (gpt-oss): gate and up clamped to it,
    swiglu_alpha: float = 1.702  # out = (up + 1) * gate * sigmoid(alpha * gate)
    # GLM-4.5's router (DeepSeek-V3's), router "sigmoid_group": sigmoid scores, plus a per-expert correction
    # bias for choosing only; the experts in n_group groups, of which the topk_group groups with the best
    # two-expert sums compete; the chosen ones' unbiased scores (renormalised with norm_topk_prob) times routed_scale
    routed_scale: float = 1.0  # routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    shared_expert_gate: bool = True  # False: the shared expert's output is added whole, no sigmoid gate (GLM-4.5)
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint holds past the decoder's (heads/mtp.py)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE turns (an even number)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or bool(self.moe_layers[layer]))

    def mixer(self, layer: int) -> str:
        """Layer ``layer``'s token mixer: "attention", "conv" or "delta"."""
        return self.layer_mixers[layer] if self.layer_mixers else "attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that read and write the KV cache (every layer but a hybrid's recurrent ones)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.mixer(i) == "attention")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that carry a recurrent or convolution state instead of keys and values."""
        return tuple(i for i in range(self.num_hidden_layers) if self.mixer(i) != "attention")

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The attention layers with a sliding window: their keys are kept in the KV cache's windowed group
        (``KVCache.local``), whose blocks are freed once they leave the window."""
        return tuple(i for i in self.attention_layers if self.window(i))

    @property
    def group_window(self) -> int:
        """The window of the KV cache's windowed group: the largest of its layers' (0: no windowed layer)."""
        return max((self.window(i) for i in self.windowed_layers), default=0)

    def kv_index(self, layer: int) -> int:
        """Attention layer ``layer``'s index in its group of the KV cache: among the windowed layers for a
        windowed one, among the others (every earlier key) for the rest."""
        win = self.windowed_layers
        return win.index(layer) if layer in win else [i for i in self.attention_layers if i not in win].index(layer)

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: it reads every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_table(self, layer: int) -> int:
        """Which RoPE table layer ``layer`` uses: 0 the global one, 1 the windowed layers' own base, -1 none."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return -1
        return 1 if self.rope_local_theta is not None and self.window(layer) else 0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary: its keys as they are for a family whose keys are
        all ModelConfig's own (``Family.hf_plain``), else through transformers' class (``_from_family``)."""
        from specdec.families import family, text_config  # noqa: PLC0415

        d = text_config(d)
        fam = family((d.get("model_type") or "llama").lower())
        if not fam.hf_plain:
            return cls._from_family(fam, d)
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
            attention_bias=bool(d.get("attention_bias", fam.hf_qkv_bias)),
            architecture=fam.model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def _from_family(cls, fam: Any, d: dict[str, Any]) -> "ModelConfig":
        """A family read through transformers' class: the Llama fields read from its view of ``d`` (its defaults
        filled in), then the family's switches."""
        from specdec.families import switches  # noqa: PLC0415

        full, extra = switches(fam.model_type, d)
        if not fam.hf_head_dim:
            full.pop("head_dim", None)  # (Granite's attention uses hidden // heads whatever head_dim says)
        base = cls.from_hf(full)
        fields = {"attention_bias": bool(full.get("attention_bias", False)), **extra}
        return dataclasses.replace(base, architecture=fam.model_type,
                                   bos_token_id=d.get("bos_token_id", base.bos_token_id), **fields)

    def to_hf(self) -> dict[str, Any]:
        """The matching Hugging Face ``config.json`` dictionary (loadable by transformers): the keys every family
        shares, written as its row of ``specdec/families.py`` says (``Family.hf_*``), then the row's own
        (``Family.hf_keys``, the inverse of its ``switches``)."""
        from specdec.families import family  # noqa: PLC0415

        fam = family(self.architecture)
        d: dict[str, Any] = {
            "architectures": [fam.hf_class],
            "model_type": fam.model_type,
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
        d.update(self._rope_hf(fam.hf_rope))
        if not fam.hf_qkv_bias:
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        wins = [w for w in (self.layer_windows or ()) if w]
        if not fam.hf_layer_types:
            d["sliding_window"] = wins[0] if wins else None
        elif wins:
            d["sliding_window"] = wins[0]
            d["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
            d["use_sliding_window"] = True
        if self.num_experts:
            count, size = fam.hf_experts
            d.update({count: self.num_experts, "num_experts_per_tok": self.experts_per_tok,
                      size: self.moe_intermediate_size})
        if self.layer_mixers:
            names = dict(fam.hf_mixers)
            d["layer_types"] = [names.get(m, "full_attention") for m in self.layer_mixers]
        d.update(fam.hf_keys(self))
        # None as null: left out, a family's config class would fill in its own default ids
        d["bos_token_id"] = self.bos_token_id
        eos = self.eos_token_ids
        d["eos_token_id"] = (list(eos) if len(eos) > 1 else eos[0]) if eos else None
        return d

    def _rope_hf(self, layout: str) -> dict[str, Any]:
        """RoPE's keys of ``config.json`` as family row's ``hf_rope`` lays them out (``Family.hf_rope``)."""
        scaling = copy.deepcopy(self.rope_scaling or {})  # a copy: transformers' classes write into what they get
        if layout == "by_layer_type":
            return {"rope_parameters": {
                "full_attention": {"rope_type": "default", **scaling, "rope_theta": self.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}}}
        if layout == "rope_parameters":
            return {"rope_parameters": {"rope_type": "default", **scaling, "rope_theta": self.rope_theta,
                                        "partial_rotary_factor": self.partial_rotary_factor}}
        return {"rope_scaling": scaling} if scaling else {}


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


def _token_id_key(k: Any) -> Any:
    """A logit_bias key as a token id when it is a string of ASCII digits (JSON's keys are strings),
    else ``k`` as it is, for the range check to refuse. ``str.isdigit`` alone is not enough: "²" and
    "١" are digits to it, and ``int`` refuses the first and reads the second; a key of thousands of
    digits is past ``int``'s limit on strings. No token id has more than 18 digits."""
    if isinstance(k, str):
        s = k.strip()
        if s.isascii() and s.isdigit() and len(s) <= 18:
            return int(s)
    return k


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
        keys = [_token_id_key(k) for k, _ in items]
        if not all(_is_integral(k) and k >= 0 and _is_number(v) and -100.0 <= v <= 100.0
                   for k, (_, v) in zip(keys, items)):
            problems.append("logit_bias must map token ids (>= 0) to numbers in [-100, 100]")
        else:
            object.__setattr__(p, "logit_bias", {int(k): float(v) for k, (_, v) in zip(keys, items)} or None)
    for name, v in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if v is not None and not (_is_integral(v) and 0 <= v <= MAX_LOGPROBS):
            problems.append(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (top alternatives), got {v!r}")
    return problems
