"""The blocks of one paged KV cache: reference counts, free blocks and the prefix cache.

A block is ``KV_BLOCK`` consecutive slots of one sequence. Blocks are handed out from one pool;
a full block of prompt keys may be *registered* under the hash of its tokens and of every token
before it (vLLM's chain: ``key_i = H(key_{i-1}, tokens of block i)``), so another request with the
same prefix maps the same block instead of prefilling it again (Kwon et al. 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention"; vLLM's automatic prefix caching).
A registered block nobody holds stays cached in LRU order and is evicted only when the pool needs
a block. Block 0 is the null block: never handed out, all zeros, what unmapped table entries name.

Empty blocks are a stack (last freed, first reused), lowest ids first from a fresh pool: the pool's
storage is taken from the OS untouched (``KVCache.grow``), so a block becomes resident memory when it
is first written, and reusing the block just freed keeps the resident set at the peak of concurrent
use plus the cached prefixes. A queue (take from the front, give back at the back) cycled through
every block and made a long-running server's memory climb to its whole KV budget (issue 33: +0.9 MB
per request over a 4,000-request soak).
"""
from __future__ import annotations

import collections
import hashlib
from array import array


class NoFreeBlocks(RuntimeError):
    """The pool has no block left (the engine preempts before this can happen)."""


def block_hashes(token_ids: list[int], block: int, parent: bytes = b"") -> list[bytes]:
    """The chain keys of every full block of ``token_ids`` (``len // block`` of them)."""
    keys = []
    for lo in range(0, len(token_ids) - block + 1, block):
        parent = hashlib.blake2b(parent + array("q", token_ids[lo:lo + block]).tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """Blocks ``1..num_blocks-1`` with reference counts; free ones are either empty (a stack: the last
    freed is the next taken) or cached (LRU)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.empty = list(range(num_blocks - 1, 0, -1))  # a stack: pop() takes the top, block 1 first
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # free, registered: LRU first
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    def allocate(self) -> int:
        """A block of no one, held once: the empty one freed last (never-used ones after every used one),
        else the least recently used cached one."""
        if self.empty:
            b = self.empty.pop()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)
            self.unregister(b)
        else:
            raise NoFreeBlocks("the KV cache has no free block")
        self.ref[b] = 1
        return b

    def hold(self, b: int) -> None:
        if self.ref[b] == 0:
            self.cached.pop(b)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.key_of:
                self.cached[b] = None
            else:
                self.empty.append(b)

    def register(self, b: int, key: bytes) -> None:
        """``b`` holds the prefix named by ``key`` (the first block registered under a key stays)."""
        if key not in self.block_of and b not in self.key_of:
            self.block_of[key], self.key_of[b] = b, key

    def unregister(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None:
            del self.block_of[key]

    def match(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest registered run of ``keys`` from the first (not held yet)."""
        found = []
        for key in keys:
            b = self.block_of.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def grow(self, num_blocks: int) -> None:
        """Add blocks ``num_blocks..``: below every empty one, so they are taken only once those are."""
        self.empty[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)
        self.ref += [0] * (num_blocks - self.num_blocks)
        self.num_blocks = num_blocks
