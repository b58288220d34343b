"""Paged KV cache addressed by position (gpt-fast's position-addressed slots, vLLM's pages).

Row ``r`` (a table row) holds one sequence; slot ``s`` holds the keys and values of the token at
position ``s``, stored in block ``table[r, s // KV_BLOCK]`` at offset ``s % KV_BLOCK``. Blocks come
from one pool (``BlockPool``) as a sequence's slots are first written, drafts and tree nodes past
its length included, and go back when the row is freed: memory follows use, not the worst case. A
rejected draft still needs no rollback: its slots lie beyond the sequence's current length, every
query masks keys past its own position, and the next step overwrites them.

Full blocks of prompt keys can be shared between rows (prefix caching, see ``block_pool``); a row
about to write into a block another row also maps gets its own copy first (copy-on-write).

Layers with a sliding window (Gemma 2/3, gpt-oss, Mistral) keep their keys in a second cache of the same
shape, ``local`` (vLLM's sliding-window KV cache group): its table is addressed by the same slots, and a
block whose every slot has left the window of every query the row can still make is given back to its
pool (its table entry names the null block again, which the window's mask hides). A row's memory is
then bounded by its global layers' keys plus a window's worth of the windowed layers', whatever its
context. A row may step back (a rejected draft, a drafter re-reading its last tokens) by up to
``WINDOW_SLACK`` positions behind the first slot of the forward before (of all its parts, and of a token
tree's mask, which a drafter widens over the nodes it fed before: ``models.masks.first_slots``); a write
reading keys already freed raises instead of reading zeros.
"""
from __future__ import annotations

import os

import torch

from specdec.kernels import hugepages
from specdec.runtime.block_pool import BlockPool, NoFreeBlocks, block_hashes

KV_BLOCK = 32  # slots per block; attention also reads keys in whole blocks (see models.llama.attention)
WINDOW_SLACK = 4 * KV_BLOCK  # keys a windowed group keeps behind a row's window (how far a row may step back)
WINDOW_SPAN = 1024  # slots one forward writes per row, at most, in the engine (prompt chunks are <= 512)


def blocks_for(length: int) -> int:
    return -(-length // KV_BLOCK)


def window_row_blocks(window: int, max_len: int) -> int:
    """Blocks a row of a windowed group holds at most while it writes up to ``WINDOW_SPAN`` slots a forward
    (a pool of that many per row never runs short in the engine; a longer write grows the pool)."""
    return min(blocks_for(max_len), blocks_for(window + WINDOW_SLACK + WINDOW_SPAN) + 2)


def memory_bytes(memory: str | float | int | None) -> int:
    """A KV cache budget in bytes: ``"2GB"``, ``"512MiB"``, a byte count, or a fraction of this
    machine's memory (``0.4``, the default for None)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    memory = 0.4 if memory is None else memory
    text = str(memory).strip().upper()
    num = text.rstrip("KMGIB")
    try:
        value = float(num)
        scale = units[text[len(num):].strip()]
    except (ValueError, KeyError):
        raise ValueError(f"a KV cache memory is bytes (2GB, 512MiB) or a fraction of the memory (0.4), got {memory!r}")
    if scale == 1 and 0 < value < 1:
        return int(value * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if value < 1:
        raise ValueError(f"a KV cache memory must be positive, got {memory!r}")
    return int(value * scale)


class KVCache:
    """Keys and values of every layer: ``k[layer]`` is ``(num_blocks, n_kv_heads, KV_BLOCK, head_dim)``;
    ``table (rows, max_len / KV_BLOCK)`` maps a row's block index to a pool block (0: unmapped).

    ``window`` > 0 makes it a windowed group (see the module's docstring); ``local`` is the windowed group
    of a model's windowed layers beside this one (None: none), kept in step by every method here."""

    def __init__(self, n_layers: int, rows: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_blocks: int | None = None,
                 window: int = 0) -> None:
        self.window = window
        self.local: KVCache | None = None
        self.trimmed: list[int] = []  # a windowed group's rows: blocks below this index are all freed
        self.rows, self.max_len = 0, 0
        self.shape = (n_layers, 0, n_kv_heads, KV_BLOCK, head_dim)
        self.k = self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        self.pool = BlockPool(2)
        self.table = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.blocks: list[list[int]] = []  # per row, the table's mapped prefix (a Python mirror)
        self.epoch: list[int] = []  # per row, how many times it was freed (what it holds may have changed)
        self.queries = self.hits = 0  # prefix-cache lookups and hits, in tokens (vLLM's counters)
        self.grow(rows, max_len, num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_bytes(self) -> int:
        """Bytes of one block, keys and values of every layer."""
        return 2 * self.k[:, :1].numel() * self.k.element_size() if self.k.shape[1] else 0

    def grow(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        """At least ``rows`` table rows of ``max_len`` slots and ``num_blocks`` pool blocks (None:
        enough for every row's every slot; a windowed group's, for every row's window), in place, keeping
        every block and mapping it holds (requests may be running). Pool storage is taken from the OS
        untouched, so only the blocks written become resident."""
        max_len = max(self.max_len, blocks_for(max_len) * KV_BLOCK)
        rows = max(rows, self.rows)
        if self.window:  # a windowed group: a row holds a window's blocks, not its context's; a pool of that many
            # (its budget, Transformer.window_bytes) takes the blocks a prefix cache keeps again once its never-used
            # ones are gone, rather than growing to every row's whole context
            num_blocks = max(num_blocks or 0, rows * window_row_blocks(self.window, max_len) + 1)
        elif num_blocks is None:
            num_blocks = rows * blocks_for(max_len) + 1
        if (rows, max_len) != (self.rows, self.max_len):
            table = torch.zeros(rows, max_len // KV_BLOCK, dtype=torch.long, device=self.table.device)
            table[:self.rows, :self.table.shape[1]] = self.table
            self.table, self.rows, self.max_len = table, rows, max_len
            self.blocks += [[] for _ in range(rows - len(self.blocks))]
            self.epoch += [0] * (rows - len(self.epoch))
            self.trimmed += [0] * (rows - len(self.trimmed))
        n = self.k.shape[1]
        if num_blocks > n:
            shape = (self.shape[0], num_blocks, *self.shape[2:])
            k = hugepages.empty(shape, self.k.dtype, self.k.device)  # on CPU, 2 MB pages: fewer TLB misses in attention
            v = hugepages.empty(shape, self.k.dtype, self.k.device)
            k[:, 0] = 0  # the null block
            v[:, 0] = 0
            if n:
                live = torch.tensor([b for b in range(1, n) if self.pool.ref[b] or b in self.pool.key_of], dtype=torch.long)
                k[:, live], v[:, live] = self.k[:, live], self.v[:, live]
                self.pool.grow(num_blocks)
            else:
                self.pool = BlockPool(num_blocks)
            self.k, self.v = k, v
        if self.local is not None:
            self.local.grow(rows, max_len)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors a captured forward reads (keys, values, table; the windowed group's after them)."""
        return (self.k, self.v, self.table) + (() if self.local is None else self.local.tensors())

    # ---- blocks of a row ------------------------------------------------------------------
    def blocks_needed(self, row: int, length: int, start: int | None = None) -> int:
        """Blocks row ``row`` takes from the pool to hold slots ``[0, length)`` and, from ``start`` (None:
        nothing written), to write slots ``[start, length)``: the unmapped blocks and a copy of every
        shared one the writes fall in (copy-on-write), what ``prepare_writes`` would take."""
        length = min(length, self.max_len)
        if length <= 0:
            return 0
        if start is None or start >= length:
            return max(0, blocks_for(length) - len(self.blocks[row]))
        return self._blocks_to_write([(row, max(start, 0) // KV_BLOCK, (length - 1) // KV_BLOCK)])

    def free(self, row: int) -> None:
        """Give the row's blocks back (a cached prefix block stays cached)."""
        for b in self.blocks[row]:
            if b:
                self.pool.release(b)
        self.blocks[row] = []
        self.table[row] = 0
        self.epoch[row] += 1
        if self.window:
            self.trimmed[row] = 0
        if self.local is not None:
            self.local.free(row)

    def holds_end(self, row: int, length: int) -> bool:
        """Whether the row still holds every key a block starting at slot ``length`` reads (a windowed
        group may have freed the keys behind its window)."""
        if self.local is not None and not self.local.holds_end(row, length):
            return False
        return not self.window or all(self.blocks[row][i] for i in self._window_blocks(row, length))

    def _window_blocks(self, row: int, start: int) -> range:
        """A windowed group: the mapped blocks holding keys a query at slot ``start`` reads from before it."""
        return range(max(0, start - self.window + 1) // KV_BLOCK, min(blocks_for(start), len(self.blocks[row])))

    def _trim(self, row: int, start: int) -> None:
        """A windowed group whose row writes from slot ``start`` on: free the blocks every later query of the
        row leaves behind its window (``WINDOW_SLACK`` positions kept for a step back)."""
        keep_from = min(max(0, start - self.window + 1 - WINDOW_SLACK) // KV_BLOCK, len(self.blocks[row]))
        blocks = self.blocks[row]
        for i in range(self.trimmed[row], keep_from):
            if blocks[i]:
                self.pool.release(blocks[i])
                blocks[i] = 0
                self.table[row, i] = 0
        self.trimmed[row] = max(self.trimmed[row], keep_from)

    def share_row(self, src: int, dst: int, length: int) -> None:
        """Map into the (empty) row ``dst`` the blocks holding slots ``[0, length)`` of row ``src``; a
        shared block is copied when either row writes into it (``_writable``)."""
        keep = self.blocks[src][:blocks_for(length)]
        for b in keep:
            if b:
                self.pool.hold(b)
        self.blocks[dst] = list(keep)
        if keep:
            self.table[dst, :len(keep)] = torch.tensor(keep)
        if self.window:
            self.trimmed[dst] = self.trimmed[src]
        if self.local is not None:
            self.local.share_row(src, dst, length)

    def _blocks_to_write(self, spans: list[tuple[int, int, int]]) -> int:
        """Blocks the pool gives up when blocks ``first..last`` of each ``(row, first, last)`` in turn are
        mapped (``[0, last]``) and made the row's own: every unmapped one, and a copy of every one
        still shared then (a block two rows share is copied by the first that writes into it only)."""
        refs: dict[int, int] = {}  # block -> holders left once the spans before have copied it
        mapped: dict[int, int] = {}  # row -> blocks mapped once the spans before have run
        own: set[tuple[int, int]] = set()  # (row, block index) copied by a span before
        n = 0
        for row, first, last in spans:
            blocks = self.blocks[row]
            for i in range(first, min(last + 1, len(blocks))):
                b = blocks[i]
                if not b:  # freed behind a window, written again (a row stepping back, a prompt again)
                    n += 1
                    continue
                ref = refs.get(b, self.pool.ref[b])
                if ref > 1 and (row, i) not in own:
                    n += 1
                    refs[b] = ref - 1
                    own.add((row, i))
            have = mapped.get(row, len(blocks))
            if last + 1 > have:
                n += last + 1 - have
                mapped[row] = last + 1
        return n

    def _map(self, row: int, upto: int, first: int = 0) -> list[int]:
        """Map blocks ``[0, upto)`` of the row (a windowed group: ``[first, upto)``, the ones written);
        returns the new ones (to be zeroed). The pool must have them (``prepare_writes`` checks first), so
        the list and the table never disagree."""
        have = self.blocks[row]
        new = []
        for i in range(first, min(upto, len(have)) if self.window else 0):  # only a windowed group has holes
            if not have[i]:
                have[i] = self.table[row, i] = self.pool.allocate()
                new.append(have[i])
        extra = [self.pool.allocate() for _ in range(upto - len(have))]
        if extra:
            self.table[row, len(have):upto] = torch.tensor(extra)
            have += extra
        if self.window:
            self.trimmed[row] = min(self.trimmed[row], first)
        return new + extra

    def _writable(self, row: int, first: int, last: int) -> None:
        """Blocks ``first..last`` of the row become its own: a shared one is copied (copy-on-write),
        a registered one of its own leaves the prefix cache (its keys are about to change)."""
        for i in range(first, last + 1):
            b = self.blocks[row][i]
            if self.pool.ref[b] > 1:
                c = self.pool.allocate()
                self.k[:, c], self.v[:, c] = self.k[:, b], self.v[:, b]
                self.pool.release(b)
                self.blocks[row][i] = c
                self.table[row, i] = c
            else:
                self.pool.unregister(b)

    def prepare_writes(self, rows: torch.Tensor, cache_pos: torch.Tensor, since: dict[int, int] | None = None
                       ) -> None:
        """Map (and make the row's own) every block the slots ``cache_pos (B, T)`` of ``rows`` fall in, all
        or nothing: ValueError for a slot past the cache's length, NoFreeBlocks when the pool lacks a
        block the writes take, new or a copy (nothing taken, mapped or copied then). ``since``: per row, the
        first slot of the whole forward (``models.masks.first_slots``: prompt chunks riding it are mapped
        by calls of their own before any part computes; a tree's mask reaches back over nodes fed before): a windowed
        group then frees only what leaves the window behind that slot, never keys an earlier part of the
        forward has yet to write or read, nor the keys a tree's root reads."""
        fresh, los, his = [], cache_pos.amin(1).tolist(), cache_pos.amax(1).tolist()
        last = max(his)
        if last >= self.max_len:
            raise ValueError(f"position {last} is past the KV cache length {self.max_len}")
        spans = [(r, lo // KV_BLOCK, hi // KV_BLOCK)
                 for r, lo, hi in zip(rows.tolist(), los, his)]
        if self.window:
            for r, lo in zip(rows.tolist(), los):
                gone = [i for i in self._window_blocks(r, lo) if not self.blocks[r][i]]
                if gone:
                    raise ValueError(f"row {r} writes from slot {lo}, but the keys of slots {gone[0] * KV_BLOCK} .. "
                                     f"{(gone[-1] + 1) * KV_BLOCK - 1} it reads in its window of {self.window} were "
                                     f"freed: a row may step back at most {WINDOW_SLACK} positions")
                self._trim(r, lo if since is None else min(lo, since.get(r, lo)))
        need = self._blocks_to_write(spans)
        if need > self.pool.num_free:
            if not self.window:
                raise NoFreeBlocks(f"the KV cache has {self.pool.num_free} free blocks, these writes take {need}")
            self.grow(self.rows, self.max_len, self.num_blocks + need - self.pool.num_free + self.rows)
        if self.local is not None:
            self.local.prepare_writes(rows, cache_pos, since)
        for r, first, hi_block in spans:
            fresh += self._map(r, hi_block + 1, first if self.window else 0)
            self._writable(r, first, hi_block)
        if fresh:  # stale or never written memory: masked keys must still be finite numbers
            idx = torch.tensor(fresh)
            self.k[:, idx] = 0
            self.v[:, idx] = 0

    # ---- reading and writing --------------------------------------------------------------
    def slot_index(self, rows: torch.Tensor | None, cache_pos: torch.Tensor, prepare: bool = True
                   ) -> tuple[torch.Tensor, ...]:
        """Index tuple for ``index_put_`` writing ``(B, H, T, D)`` values at ``cache_pos (B, T)`` (mapping
        the blocks they fall in; ``prepare=False``: the caller has, and this part makes no host
        synchronization, as a CUDA graph needs)."""
        b, t = cache_pos.shape
        if rows is None:
            rows = torch.arange(b, device=cache_pos.device)
        if prepare:
            self.prepare_writes(rows, cache_pos)
        blocks = self.table[rows.view(b, 1), cache_pos // KV_BLOCK]  # (B, T)
        n_heads = self.k.shape[2]
        heads = torch.arange(n_heads, device=cache_pos.device)
        return blocks.view(b, 1, t), heads.view(1, n_heads, 1), (cache_pos % KV_BLOCK).view(b, 1, t)

    def write(self, layer: int, index: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v (B, H, T, D)`` at the slots named by ``index`` (from :meth:`slot_index`)."""
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def gather_index(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """``(B, n_kv_heads, length)``: where slots ``[0, length)`` of ``rows (B,)`` lie in a layer seen
        as ``(blocks * n_kv_heads * KV_BLOCK, head_dim)`` (for :meth:`read`; one per forward)."""
        H = self.k.shape[2]
        pos = torch.arange(length, device=self.table.device)
        blocks = self.table[rows.view(-1, 1), pos // KV_BLOCK]  # (B, L)
        return (blocks.unsqueeze(1) * H + torch.arange(H, device=pos.device).view(1, H, 1)) * KV_BLOCK + pos % KV_BLOCK

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``index (B, H, L)`` (from :meth:`gather_index`), gathered from their blocks
        in one copy: ``(B, H, L, head_dim)`` each."""
        d = self.k.shape[-1]
        return tuple(x[layer].view(-1, d).index_select(0, index.view(-1)).view(*index.shape, d) for x in (self.k, self.v))

    def copy_slots(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move slots ``src (B, N)`` to ``dst (B, N)`` in every layer (compacting an accepted tree path)."""
        if self.local is not None:
            self.local.copy_slots(rows, src, dst)
        self.prepare_writes(rows, dst)
        r = rows.view(-1, 1)
        sb, so = self.table[r, src // KV_BLOCK], src % KV_BLOCK
        db, do = self.table[r, dst // KV_BLOCK], dst % KV_BLOCK
        for cache in (self.k, self.v):
            vals = cache[:, sb, :, so]  # (B, N, L, H, D): advanced indices first
            cache[:, db, :, do] = vals

    # ---- prefix caching -------------------------------------------------------------------
    def share_prefix(self, row: int, token_ids: list[int], align: int) -> int:
        """Map into the (empty) row the cached blocks of the longest registered prefix of
        ``token_ids``, cut to a multiple of ``align`` tokens; returns how many tokens it covers (their
        keys need no prefill). A block cut in the middle is copied when the row writes into it."""
        keys = block_hashes(token_ids, KV_BLOCK)
        found = self.pool.match(keys)
        n = len(found) * KV_BLOCK // align * align
        if self.local is not None:  # the windowed layers' keys of the window before position n must be cached too
            n = self.local._cached_window(keys, n, align)
            self.local._map_cached(row, keys, n)
        keep = found[:blocks_for(n)]
        for b in keep:
            self.pool.hold(b)
        self.blocks[row] = list(keep)
        if keep:
            self.table[row, :len(keep)] = torch.tensor(keep)
        self.queries += len(token_ids)
        self.hits += n
        return n

    def _cached_window(self, keys: list[bytes], n: int, align: int) -> int:
        """A windowed group: the longest ``m <= n`` (a multiple of ``align``) whose window's blocks before
        ``m`` are all cached under ``keys`` (the blocks further back are not needed)."""
        while n > 0:
            if all(keys[i] in self.pool.block_of for i in range(max(0, n - self.window + 1) // KV_BLOCK, blocks_for(n))):
                return n
            n = max(0, n - align)
        return 0

    def _map_cached(self, row: int, keys: list[bytes], n: int) -> None:
        """A windowed group: map into the (empty) row the cached blocks of the window before slot ``n``."""
        first = max(0, n - self.window + 1) // KV_BLOCK
        keep = [self.pool.block_of[keys[i]] for i in range(first, blocks_for(n))]
        for b in keep:
            self.pool.hold(b)
        self.blocks[row] = [0] * first + keep
        if keep:
            self.table[row, first:first + len(keep)] = torch.tensor(keep)
        self.trimmed[row] = first

    def register_prefix(self, row: int, token_ids: list[int]) -> None:
        """The row's blocks hold the keys of ``token_ids`` (from position 0): offer its full ones to
        later requests."""
        for b, key in zip(self.blocks[row], block_hashes(token_ids, KV_BLOCK)):
            if b:  # a windowed group's blocks behind the window are freed already
                self.pool.register(b, key)
        if self.local is not None:
            self.local.register_prefix(row, token_ids)
