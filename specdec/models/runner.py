"""ModelRunner: a model, its KV cache rows and the three calls the engine makes on it."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from specdec.quant.linear import row_block, whole_products
from specdec.models.llama import ForwardOutput, PromptChunk, Transformer
from specdec.runtime.kv_cache import KVCache

GROUP_TOKENS = 512  # prompt tokens per forward when small chunks are grouped (see ModelRunner.prefill)
WHOLE_CHUNK = 512  # prompt tokens per forward of one-shot products
MAX_SHARED_PROMPTS = 64  # prompts in flight ``ModelRunner.prefill`` remembers for sharing (the latest)


def default_prefill_chunk(model: Transformer) -> int:
    """The pieces a model's prompts are prefilled in: one batch-invariant product's rows (``row_block``,
    grouped ``GROUP_TOKENS`` per forward) where the model runs natively, except bf16 weights on a CPU
    with AMX, whose one-shot products are several times faster; else ``WHOLE_CHUNK``-token one-shot
    products. Without AMX a one-shot bf16 product pays for a plain copy of every weight (the native
    tiles are the only one kept) and runs on the same dot-product instruction as the native kernel:
    the 1.5B in bf16 prefilled 69 / 1,000 / 3,000 tokens at 155 / 145 / 120 tok/s natively against
    31 / 93 / 76 (AMD EPYC, docs/bench/native.md); quantized weights as fast or faster (the 0.5B int4:
    750 against 600 tok/s at 69 tokens, level at 1,000)."""
    from specdec.kernels import _cpu_flags  # noqa: PLC0415
    from specdec.quant.qlinear import QLinear  # noqa: PLC0415
    block = row_block(model.embed_tokens.weight.dtype)
    if getattr(model, "native", None) is None or block is None:
        return WHOLE_CHUNK
    quantized = any(isinstance(m, QLinear) for m in model.modules())
    return WHOLE_CHUNK if not quantized and "amx_bf16" in _cpu_flags() else block


class ModelRunner:
    """Owns a model and a paged KV cache of ``rows`` sequences of up to ``max_len`` positions.

    A sequence holding ``n`` tokens has the keys/values of tokens ``0..n-2`` in its cache row;
    its last token is *pending*: the next step feeds it (plus any draft) to the model.
    ``num_blocks`` fixes the cache's pool (a memory budget); None sizes it for every row's
    ``max_len`` (untouched blocks cost no memory, see ``KVCache.grow``).
    """

    def __init__(self, model: Transformer, prefill_chunk: int | None = None, num_blocks: int | None = None) -> None:
        self.model = model
        self.prefill_chunk = default_prefill_chunk(model) if prefill_chunk is None else prefill_chunk
        self.num_blocks = num_blocks
        self.cache: KVCache | None = None
        # prompts in flight, as ``prefill`` wrote them from position 0: tokens -> (row, the row's epoch)
        self._prompts: dict[tuple[int, ...], tuple[int, int]] = {}
        self.share_prompts = True  # a prompt identical to one in flight maps its blocks (see ``prefill``)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def small_chunks(self) -> bool:
        """Whether a prefill chunk is at most one batch-invariant product (``row_block`` rows): such
        chunks may run grouped, ride a decode step, and write the cache bits a call of their own writes."""
        return self.prefill_chunk <= (row_block(self.model.embed_tokens.weight.dtype) or 0)

    def ensure_cache(self, rows: int, max_len: int) -> KVCache:
        """Grow the cache, in place, to at least ``rows x max_len``, keeping every block it holds
        (requests may be running)."""
        if self.cache is None:
            self.cache = self.model.new_cache(rows, max_len, self.num_blocks)
        else:
            self.cache.grow(rows, max_len, self.num_blocks)
        return self.cache

    def reuse_prefix(self, row: int, token_ids: list[int]) -> int:
        """Map into the (empty) cache row the cached blocks of the longest cached prefix of
        ``token_ids``; returns how many positions need no prefill. That count is a multiple of
        ``prefill_chunk``, so the rest is prefilled in the very chunks a whole prefill runs, and every
        cached block was written by whole chunks (``offer_prefix``): the row's cache is bit for bit
        what prefilling it all writes (bf16 rounding depends on the chunking)."""
        return self.cache.share_prefix(row, token_ids, self.prefill_chunk)

    def offer_prefix(self, row: int, token_ids: list[int]) -> None:
        """Row ``row`` holds the prefill of ``token_ids``: cache the blocks its whole chunks wrote."""
        self.cache.register_prefix(row, token_ids[:len(token_ids) // self.prefill_chunk * self.prefill_chunk])

    @torch.inference_mode()
    def prefill(self, row: int, token_ids: list[int], start: int = 0,
                hidden_layers: tuple[int, ...] = (),
                on_logits: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        """Write the cache of ``token_ids`` placed at positions ``start..`` of cache row ``row``.

        Runs in chunks so a long prompt does not need a giant activation, with the fused attention
        (see ``Transformer.forward``): every request's prompt goes through this same path, alone,
        so plain and speculative decoding see identical caches. Returns the last chunk's
        output (logits of its last token) with the requested hidden states of every token
        (``(1, len(token_ids), C)``), or None for no tokens. Chunks of at most ``row_block`` tokens
        (chunked prefill beside running streams: ``EngineCore``) run grouped, several per forward,
        and return None unless hidden states or logits are asked for.
        ``on_logits(position, logits (T, V))`` is given every chunk's logits of all its tokens (prompt
        logprobs), ``position`` being the chunk's first position (the returned logits are then those
        of the last chunk's every token).

        A prompt identical to one another row prefilled this way from position 0, and still holds (the
        ``n`` requests of one prompt, a batch of one prompt under many seeds), is not computed again:
        the row maps that row's blocks (copied when either writes into a shared one, ``KVCache``), the
        very bits a prefill of its own writes (the same tokens in the same chunks), and None is returned.
        """
        plain = on_logits is None and not hidden_layers and start == 0 and len(token_ids) > 0
        key = tuple(token_ids) if plain and self.share_prompts else None
        if key is not None and self._share(row, key):
            return None
        out = self._prefill(row, token_ids, start, hidden_layers, on_logits)
        if key is not None:
            self._prompts.pop(key, None)
            self._prompts[key] = (row, self.cache.epoch[row])
            if len(self._prompts) > MAX_SHARED_PROMPTS:
                del self._prompts[next(iter(self._prompts))]
        return out

    def _share(self, row: int, key: tuple[int, ...]) -> bool:
        """Map the blocks of the row holding the prompt ``key`` into (empty) ``row``, if one still does."""
        src = self._prompts.get(key)
        cache = self.cache
        if src is None or src[0] == row or cache.epoch[src[0]] != src[1] or cache.blocks[row]:
            return False
        if not cache.holds_end(src[0], len(key)):
            return False  # the row has decoded on past the states (or window) at the prompt's end: prefill it again
        cache.share_row(src[0], row, len(key))
        return True

    def _prefill(self, row: int, token_ids: list[int], start: int, hidden_layers: tuple[int, ...],
                 on_logits: Callable[[int, torch.Tensor], None] | None) -> ForwardOutput | None:
        if self.small_chunks and on_logits is None and not hidden_layers:
            self._prefill_grouped(row, token_ids, start)
            return None
        rows = torch.tensor([row], device=self.device)
        out = None
        hidden: dict[int, list[torch.Tensor]] = {i: [] for i in hidden_layers}
        # chunks no larger than a batch-invariant product run as _prefill_grouped's do (the native path
        # where there is one), so a prompt's cache does not depend on whether hidden states were asked for
        whole = not self.small_chunks
        for lo in range(0, len(token_ids), self.prefill_chunk):
            chunk = token_ids[lo:lo + self.prefill_chunk]
            toks = torch.tensor([chunk], device=self.device)
            pos = torch.arange(start + lo, start + lo + len(chunk), device=self.device).unsqueeze(0)
            with whole_products() if whole else nullcontext():  # path-independent: every prompt is prefilled alone, this way
                out = self.model(toks, pos, self.cache, rows=rows,
                                 logits_positions="last" if on_logits is None else "all",
                                 hidden_layers=hidden_layers, fused_attention=True)
            if on_logits is not None:
                on_logits(start + lo, out.logits[0])  # (T, V)
            for i in hidden_layers:
                hidden[i].append(out.hidden[i])
        if out is not None and len(token_ids) > self.prefill_chunk and hidden_layers:
            # hidden states of every token (1, len(token_ids), C), the chunks joined
            out = ForwardOutput(logits=out.logits, hidden={i: torch.cat(h, dim=1) for i, h in hidden.items()})
        return out

    def _prefill_grouped(self, row: int, token_ids: list[int], start: int) -> None:
        """Chunks of at most one batch-invariant product, ``GROUP_TOKENS`` tokens of them per forward
        as its parts (``Transformer.forward``'s ``prompt_chunks``): the cache a call per chunk writes,
        bit for bit (each part attends after the parts before it wrote their keys), without paying a
        forward's fixed cost per chunk (2x the prefill speed at chunks of 24 here)."""
        chunk, rows = self.prefill_chunk, torch.tensor([row], device=self.device)
        step = max(1, GROUP_TOKENS // chunk) * chunk
        for lo in range(0, len(token_ids), step):
            first, *rest = PromptChunk.split(row, token_ids[lo:lo + step], start + lo, chunk)
            pos = torch.arange(first.start, first.start + len(first.tokens), device=self.device).unsqueeze(0)
            self.model(torch.tensor([first.tokens], device=self.device), pos, self.cache,
                       rows=rows, logits_positions="none",
                       fused_attention=True, prompt_chunks=rest)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None, **kw
                ) -> ForwardOutput:
        """One step over ``tokens (B, T)`` at ``positions (B, T)``: decoding (T=1) or verification."""
        return self.model(tokens, positions, self.cache, rows=rows, **kw)
