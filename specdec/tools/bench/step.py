"""The cost of one forward against the machine's weight-read limit, for any model and weight format.

    python -m specdec.tools.bench.step --model qwen2.5-coder-1.5b --quantization int4 --rows 1,4,8,16

For each path (``native``: every layer in one native call, models/native.py; ``torch``: the PyTorch
reference with oneDNN-packed bf16 products, as before round 3) and each block of T rows of one sequence
(T = K+1 tokens as verification runs them) at a context of ``--context`` tokens: ms per forward (median
of ``--repeats``, paths interleaved), the bytes of weights a forward reads and of the cached keys and values
its attention reads (a windowed layer's within its window), the limit they put on the
time at the machine's measured read bandwidth (AVX-512 or AVX2 loads on every thread, csrc/read_bw.c), the
fraction of that limit reached and the ms beyond it; and the compute floor: T rows' multiply-adds at
the measured peak rate of the dot-product instructions (csrc/dot_peak.c), the bound a block of
several rows meets on two cores. Not a test: the numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec.quant.linear import Linear, pack_linears
from specdec.quant.qlinear import QLinear
from specdec.tools.bench.runtime import dot_peak, read_bandwidth_avx512, write_report


def read_bandwidth_gpu(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """GB/s at which the GPU reads a tensor far bigger than its cache (a sum over ``nbytes`` of bf16,
    the best of ``repeats``): the limit a forward's weight reads meet."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum(dtype=torch.float32)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del x
    return nbytes / best / 1e9


def bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one forward reads: every product's weights (LM head included), biases, norms."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, QLinear):
            total += mod.qweight.nbytes
        elif isinstance(mod, Linear):
            total += mod.in_features * mod.out_features * 2 + (4 * mod.out_features if mod.bias is not None else 0)
        elif type(mod).__name__ == "RMSNorm":
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every expert's weights, of one expert's): what ``bytes_read`` counts for the experts,
    of which a forward reads only the experts its rows touch (0, 0 for a dense model)."""
    from specdec.models.moe import MoE  # noqa: PLC0415
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        return 0, 0
    total = sum(bytes_read(e) for m in moes for e in m.experts)
    return total, bytes_read(moes[0].experts[0])


def experts_read(model: torch.nn.Module, rows: int, context: int, seed: int = 0) -> int:
    """Distinct (layer, expert) pairs one forward of ``rows`` random tokens after ``context`` others
    touches (their weights are what it reads of the experts), counted on the PyTorch path's router."""
    from specdec.models.moe import MoE  # noqa: PLC0415
    seen: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(mod.experts_touched(args[0])))
             for m in model.modules() if isinstance(m, MoE)]
    native, model.native = model.native, None  # the native forward does not call the modules
    try:
        with torch.inference_mode():
            dev = model.embed_tokens.weight.device
            gen = torch.Generator().manual_seed(seed)
            toks = torch.randint(0, model.config.vocab_size, (1, context + rows), generator=gen).to(dev)
            cache = model.new_cache(1, context + rows + 32)
            if context:
                model(toks[:, :context], torch.arange(context, device=dev).view(1, -1), cache)
            seen.clear()
            model(toks[:, context:], torch.arange(context, context + rows, device=dev).view(1, -1), cache)
    finally:
        model.native = native
        for h in hooks:
            h.remove()
    return sum(seen)


def macs_per_row(model: torch.nn.Module) -> dict[str, int]:
    """Multiply-adds of one row through every product (LM head included), by the instruction that runs
    them: ``int8`` (quantized weights: vpdpbusd) and ``bf16`` (vdpbf16ps)."""
    from specdec.models.moe import MoE  # noqa: PLC0415
    out = {"int8": 0, "bf16": 0}

    def add(mod: torch.nn.Module, share: float) -> None:
        for lin in mod.modules():
            if isinstance(lin, (QLinear, Linear)):
                out["int8" if isinstance(lin, QLinear) else "bf16"] += round(share * lin.in_features * lin.out_features)
    add(model, 1.0)
    for m in model.modules():  # a row runs k of a mixture's E experts (a shared expert, every row: counted whole)
        if isinstance(m, MoE):
            for e in m.experts:
                add(e, m.cfg.experts_per_tok / m.cfg.num_experts - 1.0)
    return out


def block_bytes(model: torch.nn.Module, rows: int, context: int) -> int:
    """Bytes of weights a forward of ``rows`` tokens reads: all of them on a dense model; on a mixture of
    experts, the experts its rows touch (``experts_read``) and everything else."""
    total, one = expert_bytes(model)
    return bytes_read(model) if not one else bytes_read(model) - total + experts_read(model, rows, context) * one


def keys_read(model: torch.nn.Module, rows: int, context: int) -> int:
    """Bytes of keys and values a forward of ``rows`` tokens after ``context`` others reads from the KV cache:
    every attention layer's, a windowed layer's only within its window (the kernels start at the window's
    first whole block: counted as the window itself)."""
    cfg = model.config
    per_key = 2 * cfg.num_key_value_heads * cfg.head_dim * model.embed_tokens.weight.element_size()
    n = context + rows
    return sum(min(n, cfg.window(i) + rows - 1) if cfg.window(i) else n for i in cfg.attention_layers) * per_key


def compute_floor_ms(macs: dict[str, int], peak: dict[str, float] | None, rows: int) -> float | None:
    """The time below which no kernel computes ``rows`` rows' products at the machine's peak rate of
    its dot-product instructions (``runtime.dot_peak``)."""
    return rows * sum(n / peak[k] for k, n in macs.items()) * 1e3 if peak else None


_QWEN35_08B = dict(architecture="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=256, num_hidden_layers=24, vocab_size=248320,
                   tie_word_embeddings=True, qk_norm="head", attn_output_gate=True, partial_rotary_factor=0.25,
                   rope_theta=1e7)

SHAPES = {  # public configurations of larger models people bring (random weights of their shapes)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                         num_hidden_layers=24, vocab_size=151936, tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                         num_hidden_layers=28, vocab_size=151936, tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                       num_hidden_layers=36, vocab_size=151936, tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                       num_hidden_layers=28, vocab_size=152064, tie_word_embeddings=False, attention_bias=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       num_hidden_layers=32, vocab_size=128256, tie_word_embeddings=False, attention_bias=False),
    # the families of specdec/families.py, at their public configurations
    "qwen3-1.7b": dict(architecture="qwen3", hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, num_hidden_layers=28, vocab_size=151936,
                       tie_word_embeddings=True, qk_norm="head"),
    "qwen3-4b": dict(architecture="qwen3", hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, num_hidden_layers=36, vocab_size=151936,
                     tie_word_embeddings=True, qk_norm="head"),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                         num_hidden_layers=28, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "gemma-3-4b": dict(architecture="gemma3_text", hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, num_hidden_layers=34, vocab_size=262208,
                       tie_word_embeddings=True, qk_norm="head", norm_placement="sandwich", activation="gelu_tanh",
                       embed_scale=2560 ** 0.5, attn_scale=256 ** -0.5, rope_local_theta=1e4,
                       rope_scaling={"rope_type": "linear", "factor": 8.0},
                       layer_windows=tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))),
    "phi-4-mini": dict(architecture="phi3", hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                       num_key_value_heads=8, num_hidden_layers=32, vocab_size=200064, tie_word_embeddings=True,
                       partial_rotary_factor=0.75, rope_theta=1e4, max_position_embeddings=131072,
                       rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48,
                                     "original_max_position_embeddings": 4096}),
    # mixture-of-experts shapes: the experts a block touches are counted per T (``experts_read``)
    "olmoe-1b-7b": dict(architecture="olmoe", hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
                        num_key_value_heads=16, num_hidden_layers=16, vocab_size=50304, qk_norm="full",
                        rope_theta=1e4, num_experts=64, experts_per_tok=8, moe_intermediate_size=1024),
    "qwen3-30b-a3b": dict(architecture="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_hidden_layers=48, vocab_size=151936,
                          qk_norm="head", num_experts=128, experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
    "gpt-oss-20b": dict(architecture="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_hidden_layers=24, vocab_size=201088,
                        attention_bias=True, o_bias=True, attn_sinks=True, activation="swiglu_oai",
                        rope_theta=1.5e5, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "original_max_position_embeddings": 4096},
                        max_position_embeddings=131072,
                        layer_windows=tuple(128 if i % 2 == 0 else 0 for i in range(24)),
                        num_experts=32, experts_per_tok=4, moe_intermediate_size=2880, router="topk_softmax",
                        router_bias=True, expert_bias=True),
    # an OLMoE-shaped model of about a billion parameters (the cost policy's workload where drafts fail)
    "olmoe-1b": dict(architecture="olmoe", hidden_size=1024, intermediate_size=512, num_attention_heads=16,
                     num_key_value_heads=16, num_hidden_layers=16, vocab_size=50304, qk_norm="full",
                     rope_theta=1e4, num_experts=64, experts_per_tok=8, moe_intermediate_size=512),
    # a hybrid: Qwen3.5-0.8B (three gated delta-net layers to each attention layer), and the same model with
    # attention in every layer (the dense model of its size a hybrid's verification block is compared with)
    "qwen3.5-0.8b": dict(_QWEN35_08B, layer_mixers=tuple("attention" if (i + 1) % 4 == 0 else "delta" for i in range(24)),
                         conv_kernel=4, delta_k_heads=16, delta_v_heads=16, delta_k_dim=128, delta_v_dim=128),
    "qwen3.5-0.8b-dense": dict(_QWEN35_08B),
    "smollm3-3b": dict(architecture="smollm3", hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                       num_key_value_heads=4, num_hidden_layers=36, vocab_size=128256, tie_word_embeddings=True,
                       rope_theta=5e6, rope_layers=tuple(0 if (i + 1) % 4 == 0 else 1 for i in range(36))),
}


def random_model(shape: str, layers: int, quantization: str | None, native: bool,
                 device: str = "cpu") -> torch.nn.Module:
    """A random-weight model of a public shape with ``layers`` of its decoder layers, built matrix by
    matrix in bf16 (no fp32 copy of the whole model), quantized and re-laid as the engine does (on a
    GPU: built there, bf16, for the engine's PyTorch path)."""
    from specdec.config import ModelConfig  # noqa: PLC0415
    from specdec.models.llama import Transformer  # noqa: PLC0415
    from specdec.quant.qlinear import quantize_model  # noqa: PLC0415
    kw = dict(SHAPES[shape])
    n_all = kw["num_hidden_layers"]
    kw["num_hidden_layers"] = layers
    for per_layer in ("layer_windows", "rope_layers", "layer_mixers"):  # a slice keeps the pattern of the whole depth's first layers
        if per_layer in kw:
            kw[per_layer] = tuple(kw[per_layer][:layers]) if layers <= n_all else None
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    kw.setdefault("rope_theta", 1e6)
    cfg = ModelConfig(**kw)
    with torch.device("meta"):
        model = Transformer(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            w = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
            if name == "weight" and p.dim() == 2:
                w.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
            else:  # norms 1, biases 0
                w.fill_(0.0 if isinstance(mod, Linear) else 1.0)
            setattr(mod, name, torch.nn.Parameter(w, requires_grad=False))
    from specdec.models.llama import rope_frequencies  # noqa: PLC0415
    model.inv_freq = rope_frequencies(cfg).to(device)
    if cfg.rope_local_theta:
        model.inv_freq_local = rope_frequencies(cfg, local=True).to(device)
    model.tie_weights()
    model.eval()
    if quantization:
        quantize_model(model, quantization)
    if device != "cpu":
        model.use_cuda_graphs(native)  # on a GPU, ``native`` asks for the CUDA graphs
        return model
    if native:
        model.make_native()
    else:
        pack_linears(model, native=False)
    return model


def cut_head(model: torch.nn.Module, name: str, n: int) -> None:
    """The model's LM head cut to the ``n`` most frequent tokens of the shipped ranking, as a drafter's
    ``draft_vocab_size`` cuts it (the 0.5B draft's default: 32768): a forward then costs what a drafted
    token does."""
    from specdec.formats.hub import resolve_model  # noqa: PLC0415
    from specdec.heads.reduced_head import ReducedHead  # noqa: PLC0415
    from specdec.heads.token_freq import draft_vocab  # noqa: PLC0415
    from specdec.formats.tokenizer import Tokenizer  # noqa: PLC0415
    tok = Tokenizer(resolve_model(name, progress=False))
    ids = draft_vocab(tok.hf, model.config.vocab_size, n, None, always=tok.eos_token_ids)
    model.lm_head = ReducedHead(model, ids)


def load(name: str, quantization: str | None, native: bool) -> torch.nn.Module:
    """The model as the engine loads it, on the native path or the PyTorch reference (oneDNN-packed)."""
    from specdec.formats.hf import load_model_config, load_state_dict  # noqa: PLC0415
    from specdec.formats.hub import gguf_source, resolve_model  # noqa: PLC0415
    from specdec.models.llama import build_model  # noqa: PLC0415
    from specdec.formats.gguf_blocks import quantize_from_file  # noqa: PLC0415
    from specdec.quant.qlinear import quantize_model  # noqa: PLC0415
    path = resolve_model(name, progress=False)
    model = build_model(load_model_config(path), load_state_dict(path, torch.bfloat16))
    if quantization:
        if quantization == "gguf":
            quantize_from_file(model, gguf_source(name, progress=False))
        else:
            quantize_model(model, quantization)
    if native:
        if not model.make_native():
            from specdec.models.native import unsupported  # noqa: PLC0415
            raise SystemExit(f"no native path: {unsupported(model)}")
    else:
        pack_linears(model, native=False)
    return model


def _sync(model: torch.nn.Module) -> None:
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()


def fill_context(model: torch.nn.Module, cache, toks: torch.Tensor) -> None:
    """The context before a timed block: ``toks (1, n)`` prefilled on a hybrid model (its states follow the
    tokens); on any other, random keys and values written straight into the cache's slots ``[0, n)``, which
    the attention reads as it reads real ones (a forward of 8k tokens through a 4B model takes minutes)."""
    n = toks.shape[1]
    if model.config.layer_mixers or not n:
        model(toks, torch.arange(n, device=toks.device).view(1, -1), cache)
        return
    cache.prepare_writes(torch.zeros(1, dtype=torch.long), torch.arange(n).view(1, -1))
    gen = torch.Generator(device=toks.device).manual_seed(0)
    for group in (cache, cache.local):
        for x in (() if group is None else (group.k, group.v)):
            x.copy_(torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32).to(x.dtype))
            x[:, 0] = 0  # the null block stays zeros


def time_forward(model: torch.nn.Module, rows: int, context: int, ready: dict | None = None) -> float:
    """Seconds of one forward of ``rows`` tokens of one sequence after ``context`` cached ones (the
    block's slots are rewritten each call, as a rejected draft's are). With ``ready`` (a dict kept by
    the caller while its models live) the context is prefilled once per model and block size: a big
    bf16 model's prefill takes seconds."""
    _ready = {} if ready is None else ready
    key = (id(model), rows, context)
    with torch.inference_mode():
        if key not in _ready:
            model.fit_state_slots(rows)  # a hybrid's state rings: the block, rewritten at the same start each call
            cache = model.new_cache(1, context + rows + 32)
            dev = model.embed_tokens.weight.device
            toks = torch.randint(0, model.config.vocab_size, (1, context + rows), device=dev)
            fill_context(model, cache, toks[:, :context])
            block, pos = toks[:, context:], torch.arange(context, context + rows, device=dev).view(1, -1)
            model(block, pos, cache)  # warm
            _ready[key] = (cache, block, pos)
        cache, block, pos = _ready[key]
        _sync(model)
        t = time.perf_counter()
        model(block, pos, cache)
        _sync(model)
        return time.perf_counter() - t


def measure(models: dict[str, torch.nn.Module], rows: list[int], context: int, repeats: int
            ) -> dict[tuple[str, int], float]:
    """Median seconds per forward for each (path, T), the paths and block sizes interleaved."""
    times: dict[tuple[str, int], list[float]] = {}
    ready: dict = {}
    for _ in range(repeats):
        for t in rows:
            for p, m in models.items():
                times.setdefault((p, t), []).append(time_forward(m, t, context, ready))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="instead of --model: random weights of a larger public shape, its whole depth (or, "
                         "with --slices, two slices of its layers extrapolated to its depth)")
    ap.add_argument("--slices", default=None,
                    help="LO,HI: with --shape, measure slices of LO and HI layers (interleaved, so a drift of the "
                         "machine's bandwidth moves both alike) and extrapolate, for shapes too big for memory")
    ap.add_argument("--quantization", default=None, choices=[None, "int4", "int8", "gguf"])
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="with --model: its LM head cut to the N most frequent tokens, as a drafter's "
                         "draft_vocab_size (the 0.5B draft's default, 32768): the cost of a drafted token")
    ap.add_argument("--rows", default="1,4,8,16", help="block sizes T (default: 1,4,8,16)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--paths", default=None,
                    help="native, torch or both (default: both, interleaved); with --device cuda: eager, graphs "
                         "(CUDA graphs) or both (default)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the PyTorch path on the GPU, against the GPU's measured read bandwidth (with --shape)")
    ap.add_argument("--output", type=Path, default=None, help="also write the figures as JSON")
    a = ap.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    known = ("eager", "graphs") if a.device == "cuda" else ("native", "torch")
    paths = (a.paths or ",".join(known)).split(",")
    if not paths or any(p not in known for p in paths):
        raise SystemExit(f"--paths on {a.device}: one or both of {', '.join(known)}, got {a.paths!r}")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is available")
        if not a.shape or a.slices or a.quantization:
            raise SystemExit("--device cuda times random weights of a --shape, whole and in bf16")
    if a.draft_vocab is not None and (a.shape or a.draft_vocab <= 0):
        raise SystemExit("--draft-vocab N (N > 0) cuts the head of a --model (its tokenizer ranks the tokens)")
    read_bw = read_bandwidth_gpu if a.device == "cuda" else read_bandwidth_avx512
    bw, peak = read_bw(), (None if a.device == "cuda" else dot_peak())
    if a.shape and a.slices:
        lo, hi = (int(x) for x in a.slices.split(","))
        full = SHAPES[a.shape]["num_hidden_layers"]
        models = {(p, n): random_model(a.shape, n, a.quantization, p == "native") for n in (lo, hi) for p in paths}
        both = measure(models, rows, a.context, a.repeats)  # slices interleaved
        m_lo, m_hi = (models[(paths[0], n)] for n in (lo, hi))
        scale = (full - hi) / (hi - lo)

        def whole(at_lo: float, at_hi: float) -> float:  # linear in layers: from HI layers to all of them
            return at_hi + (at_hi - at_lo) * scale

        nbytes = {t: int(whole(block_bytes(m_lo, t, a.context), block_bytes(m_hi, t, a.context))) for t in rows}
        kbytes = {t: int(whole(keys_read(m_lo, t, a.context), keys_read(m_hi, t, a.context))) for t in rows}
        touched = ({t: whole(experts_read(m_lo, t, a.context), experts_read(m_hi, t, a.context)) for t in rows}
                   if expert_bytes(m_hi)[1] else None)
        macs_lo, macs_hi = macs_per_row(m_lo), macs_per_row(m_hi)
        macs = {k: int(whole(macs_lo[k], macs_hi[k])) for k in macs_hi}
        del models, m_lo, m_hi
        times = {(p, t): whole(both[((p, lo), t)], both[((p, hi), t)]) for p in paths for t in rows}
        name = f"{a.shape} (random weights, {full} layers: slices of {lo} and {hi} extrapolated)"
    else:
        if a.shape:
            full = SHAPES[a.shape]["num_hidden_layers"]
            models = {p: random_model(a.shape, full, a.quantization, p in ("native", "graphs"), a.device) for p in paths}
            name = f"{a.shape} (random weights, {full} layers)"
        else:
            models = {p: load(a.model, a.quantization, p == "native") for p in paths}
            name = a.model
            if a.draft_vocab:
                for m in models.values():
                    cut_head(m, a.model, a.draft_vocab)
                name = f"{a.model} ({a.draft_vocab}-token draft head)"
        first = next(iter(models.values()))
        nbytes = {t: block_bytes(first, t, a.context) for t in rows}
        kbytes = {t: keys_read(first, t, a.context) for t in rows}
        touched = {t: experts_read(first, t, a.context) for t in rows} if expert_bytes(first)[1] else None
        macs = macs_per_row(first)
        times = measure(models, rows, a.context, a.repeats)
    after = read_bw()  # the machine's bandwidth drifts: the mean of before and after
    if bw and after:
        print(f"read bandwidth {bw:.1f} GB/s before the forwards, {after:.1f} after")
        bw = (bw + after) / 2
    fmt = a.quantization or "bf16"
    # the limit: the weights and the cached keys and values a forward reads, at the read bandwidth
    limits = {t: (n + kbytes[t]) / (bw * 1e9) * 1e3 if bw else None for t, n in nbytes.items()}
    limit = limits[rows[0]]
    how = torch.cuda.get_device_name() if a.device == "cuda" else "wide loads, all threads"
    # no bandwidth where the probe does not run (no gcc): the limits and fractions are left out, not a crash
    print(f"{name} {fmt}: {nbytes[rows[0]] / 1e6:.0f} MB of weights and {kbytes[rows[0]] / 1e6:.0f} MB of cached keys "
          f"and values read per forward of T={rows[0]}; read bandwidth "
          + (f"{bw:.1f} GB/s ({how}); limit {limit:.2f} ms; " if bw else "unknown (the probe did not run); ")
          + f"context {a.context}")
    if touched is not None:  # a mixture of experts: the bytes, and so the limit, grow with the experts a block touches
        if a.shape and a.slices:  # every layer of these shapes is a mixture
            n_moe = SHAPES[a.shape]["num_hidden_layers"]
        else:
            cfg = next(iter(models.values())).config
            n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
        print("| T | experts touched (all layers) | per MoE layer | MB read | read limit ms |")
        print("|---|---|---|---|---|")
        for t in rows:
            per = f"{touched[t] / n_moe:.1f}" if n_moe else "-"
            lim = "-" if limits[t] is None else f"{limits[t]:.2f}"
            print(f"| {t} | {touched[t]:.0f} | {per} | {nbytes[t] / 1e6:.0f} | {lim} |")
    if peak:
        print(f"dot products at peak (all threads): {peak['int8'] / 1e9:.0f} G int8 and {peak['bf16'] / 1e9:.0f} G bf16 "
              f"multiply-adds/s; compute floor = T x the multiply-adds at that rate")
    print("| path | T | ms | fraction of the read limit | ms beyond it | compute floor ms | fraction of the bound "
          "(max of limit and floor) | T / T=1 |")
    print("|---|---|---|---|---|---|---|---|")
    report = {"model": name, "format": fmt, "device": a.device, "bytes": nbytes[rows[0]],
              "kv_bytes_by_rows": kbytes, "bandwidth_gbs": bw,
              "limit_ms": limit, "bytes_by_rows": nbytes, "limit_ms_by_rows": limits, "experts_touched": touched, "macs_per_row": macs, "dot_peak": peak, "rows": {}}
    for p in paths:
        one = times[(p, rows[0])] * 1e3
        for t in rows:
            ms, limit = times[(p, t)] * 1e3, limits[t]
            frac = limit / ms if limit else float("nan")
            floor = compute_floor_ms(macs, peak, t)
            bound = max(limit or 0.0, floor or 0.0)
            print(f"| {p} | {t} | {ms:.2f} | {frac:.2f} | {ms - (limit or 0):.2f} | "
                  f"{'-' if floor is None else f'{floor:.2f}'} | {bound / ms:.2f} | {ms / one:.2f} |")
            report["rows"][f"{p}/{t}"] = {"ms": ms, "fraction": frac, "compute_floor_ms": floor,
                                          "fraction_of_bound": bound / ms}
    if a.output:
        write_report(a.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
