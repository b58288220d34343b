"""The KV cache of a hybrid model, with the states of its recurrent layers beside the keys and values.

A gated delta-net layer (Qwen3.5) carries a matrix per head from token to token; a short-convolution
layer (LFM2), and the convolution in front of a delta-net, needs the inputs of the last few tokens.
Both are kept as the KV cache keeps keys: **addressed by position**. Each row holds a ring of
``slots`` entries per state layer; the token at position ``p`` writes its convolution input and its
recurrent state (the state *after* it) to entry ``p mod slots``, and a block of tokens starting at
``p`` reads the state after ``p - 1`` and the inputs of ``p - width + 1 .. p - 1``. A rejected draft
then needs nothing undone: its entries lie past the sequence's length and the next block, which
starts right after the last accepted token, reads the entries that token (or an earlier one) wrote
and overwrites the rest. No accepted token is ever computed twice.

The ring must hold a whole verification block and what the blocks after it read from before their first
token (``slots_for``: K + 1 + max(1, width - 1) entries for draft length K and a convolution of ``width``
taps; the engine sizes the rings so, ``Transformer.fit_state_slots``). A prompt chunk longer than the ring keeps only
its last ``slots`` entries, all the next block reads. Every entry carries the position it holds, and
a read of an entry that holds another position raises instead of computing from a wrong state.

The states are fp32 (plain decoding keeps them so; bf16 rounding would compound token after token),
counted in the memory a request takes (``state_bytes``). A token tree would need each node to read
its parent's entry and the accepted branch's entries moved into place; trees are refused on hybrid
models (``models.llama``). Prefix caching is off for hybrid models (a cached prefix's blocks outlive the
states at its end); a prompt identical to one another row prefilled and still holds maps that row's blocks
and copies its rings, while they still hold the state at the prompt's end (``holds_end``), else it is
prefilled again.
"""
from __future__ import annotations

import torch

from specdec.runtime.kv_cache import KVCache

DEFAULT_SLOTS = 8  # the engine widens the rings for its draft length (slots_for)


def slots_for(block: int, width: int) -> int:
    """Ring entries that let a block of ``block`` tokens be written while any later block (starting anywhere
    from the block's second token to just past it, or at its first token again) still finds what it reads
    from before its first token: the state after the token before it and ``width - 1`` convolution inputs."""
    return block + max(1, width - 1)


class HybridCache(KVCache):
    """``KVCache`` over the attention layers only, plus per state layer ``s``: ``inputs[s] (rows, slots,
    conv_dim)`` (the convolution's inputs, the model's dtype), ``states[s] (rows, slots, heads, dk, dv)``
    (fp32, delta-net layers; None for short convolutions) and ``held[s] (rows, slots)`` (the position
    each entry holds, -1: none)."""

    def __init__(self, n_layers: int, rows: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_blocks: int | None = None, *,
                 conv_dims: list[int], state_shapes: list[tuple[int, int, int] | None], slots: int = DEFAULT_SLOTS,
                 width: int = 1) -> None:
        self.conv_dims, self.state_shapes, self.slots, self.width = conv_dims, state_shapes, slots, width
        self.inputs: list[torch.Tensor] = []
        self.states: list[torch.Tensor | None] = []
        self.held = torch.zeros(len(conv_dims), 0, slots, dtype=torch.long)
        self._dtype, self._device = dtype, device
        super().__init__(n_layers, rows, n_kv_heads, max_len, head_dim, dtype, device, num_blocks)

    def state_bytes(self) -> int:
        """Bytes of one row's rings, every state layer."""
        return row_state_bytes(self.conv_dims, self.state_shapes, self.slots, self._dtype)

    def grow(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        old = self.rows
        super().grow(rows, max_len, num_blocks)
        if self.rows > old or not self.inputs:
            self._resize(self.rows, self.slots)

    def ensure_slots(self, slots: int) -> None:
        """Rings of at least ``slots`` entries (``slots_for``); growing
        them forgets what they hold, so only between requests (no row holds a sequence)."""
        if slots > self.slots:
            if any(self.blocks):
                raise RuntimeError("the state rings of a hybrid model can only grow while no request runs")
            self._resize(self.rows, slots)

    def _resize(self, rows: int, slots: int) -> None:
        """Rings for ``rows`` rows of ``slots`` entries: the first rows' entries are kept when the width stays
        (more rows), none when it changes (an entry's index is its position mod the width). Built aside and
        swapped in at the end: a failure leaves the old rings."""
        keep = min(self.held.shape[1], rows) if slots == self.slots else 0
        held = torch.full((len(self.conv_dims), rows, slots), -1, dtype=torch.long)
        if keep:
            held[:, :keep] = self.held[:, :keep]
        inputs, states = [], []
        for s, (d, shape) in enumerate(zip(self.conv_dims, self.state_shapes)):
            x = torch.zeros(rows, slots, d, dtype=self._dtype, device=self._device)
            st = None if shape is None else torch.zeros(rows, slots, *shape, dtype=torch.float32, device=self._device)
            if keep:
                x[:keep] = self.inputs[s][:keep]
                if st is not None:
                    st[:keep] = self.states[s][:keep]
            inputs.append(x)
            states.append(st)
        self.inputs, self.states, self.held, self.slots = inputs, states, held, slots

    def free(self, row: int) -> None:
        super().free(row)
        self.held[:, row] = -1

    def holds_end(self, row: int, length: int) -> bool:
        """Whether the row's rings still hold what a block starting at ``length`` reads: the state after
        ``length - 1`` and the ``width - 1`` convolution inputs before it."""
        pos = torch.arange(length - max(1, self.width - 1), length).clamp(min=-1)
        pos = pos[pos >= 0]
        return super().holds_end(row, length) and bool((self.held[:, row, pos % self.slots] == pos).all())

    def share_row(self, src: int, dst: int, length: int) -> None:
        """``KVCache.share_row``, and the rings of ``src`` copied into ``dst`` (``holds_end`` must be true;
        entries past ``length`` are not carried: ``dst`` writes its own)."""
        if not self.holds_end(src, length):
            raise RuntimeError(f"row {src} no longer holds the states at position {length - 1}")
        super().share_row(src, dst, length)
        for x in (*self.inputs, *(s for s in self.states if s is not None)):
            x[dst] = x[src]
        held = self.held[:, src].clone()
        self.held[:, dst] = held.masked_fill(held >= length, -1)

    def mark_written(self, rows: torch.Tensor, length: int) -> None:
        """The rings of ``rows`` taken to hold positions ``length - slots .. length - 1`` as they are (zeros in
        a fresh cache): a scratch cache timing a block after ``length`` tokens (``engine.budget``), whose
        cost does not depend on the states' values."""
        pos = torch.arange(max(0, length - self.slots), length)
        for r in rows.tolist():
            self.held[:, r, pos % self.slots] = pos

    def share_prefix(self, row: int, token_ids: list[int], align: int) -> int:
        return 0  # prefix caching is off for hybrid models: no cached prefix to map

    def register_prefix(self, row: int, token_ids: list[int]) -> None:
        pass

    def copy_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise RuntimeError("token trees are not supported on hybrid models")

    # ---- reading and writing --------------------------------------------------------------
    def _check(self, s: int, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Entries of positions ``pos (B, N)`` (those >= 0) of ``rows`` must hold those positions."""
        ok = pos < 0
        held = self.held[s][rows.cpu().view(-1, 1), pos.cpu().clamp(min=0) % self.slots]
        bad = ~(ok.cpu() | (held == pos.cpu()))
        if bool(bad.any()):
            b, j = (int(v) for v in bad.nonzero()[0])
            raise RuntimeError(f"the state of row {int(rows[b])} at position {int(pos[b, j])} is not kept "
                               f"(its ring of {self.slots} entries holds position {int(held[b, j])})")

    def read_inputs(self, s: int, rows: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
        """The convolution inputs of positions ``start - width .. start - 1`` of each row, ``(B, width,
        conv_dim)``; zeros before position 0."""
        pos = start.view(-1, 1) + torch.arange(-width, 0, device=start.device)  # (B, width)
        self._check(s, rows, pos)
        x = self.inputs[s][rows.view(-1, 1), pos.clamp(min=0) % self.slots]
        return x.masked_fill((pos < 0).unsqueeze(-1), 0)

    def read_state(self, s: int, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The recurrent state after position ``start - 1`` of each row ``(B, heads, dk, dv)``, fp32;
        zeros for a row starting at position 0."""
        before = (start - 1).view(-1, 1)
        self._check(s, rows, before)
        st = self.states[s][rows, before[:, 0].clamp(min=0) % self.slots]
        return st.masked_fill((before < 0).view(-1, 1, 1, 1), 0)

    def write_state(self, s: int, rows: torch.Tensor, pos: torch.Tensor, inputs: torch.Tensor,
              states: torch.Tensor | None = None) -> None:
        """Store the convolution ``inputs (B, N, conv_dim)`` and the ``states (B, N, heads, dk, dv)`` after
        positions ``pos (B, N)`` (the caller passes at most ``slots`` of a block's last positions)."""
        at = (rows.view(-1, 1), pos % self.slots)
        self.inputs[s][at] = inputs.to(self._dtype)
        if states is not None:
            self.states[s][at] = states
        self.held[s][rows.cpu().view(-1, 1), pos.cpu() % self.slots] = pos.cpu()


def row_state_bytes(conv_dims: list[int], state_shapes: list[tuple[int, int, int] | None], slots: int,
                    dtype: torch.dtype) -> int:
    """Bytes of one row's state rings: constant in the context length."""
    size = torch.tensor([], dtype=dtype).element_size()
    per = sum(d * size + (0 if sh is None else 4 * sh[0] * sh[1] * sh[2]) for d, sh in zip(conv_dims, state_shapes))
    return per * slots
