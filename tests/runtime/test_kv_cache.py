"""The paged KV cache: blocks on first write, freed rows, copy-on-write, prefix sharing, the pool."""
import pytest
import torch

from specdec.runtime.block_pool import BlockPool, NoFreeBlocks, block_hashes
from specdec.runtime.kv_cache import KV_BLOCK, WINDOW_SLACK, KVCache, blocks_for
from kv_util import row_kv


def write(cache, row, lo, hi, value):
    """Write ``value`` as every key and value of slots ``lo..hi-1`` of ``row`` in every layer."""
    idx = cache.slot_index(torch.tensor([row]), torch.arange(lo, hi)[None])
    x = torch.full((1, cache.k.shape[2], hi - lo, cache.k.shape[-1]), float(value))
    for layer in range(cache.k.shape[0]):
        cache.write(layer, idx, x, x)


def test_blocks_are_taken_on_first_write_and_given_back_on_free():
    c = KVCache(2, 3, 2, 256, 8, torch.float32, num_blocks=9)
    assert c.pool.num_used == 0
    write(c, 1, 0, 40, 1.0)  # 2 blocks
    write(c, 2, 100, 101, 2.0)  # a draft slot far out: blocks 0..3 of row 2
    assert c.pool.num_used == 6 and c.blocks_needed(1, 96) == 1
    assert torch.equal(row_kv(c, 1, 40), torch.ones_like(row_kv(c, 1, 40)))
    c.free(2)
    assert c.pool.num_used == 2 and c.table[2].eq(0).all()
    write(c, 0, 0, 6 * KV_BLOCK, 3.0)
    with pytest.raises(NoFreeBlocks):
        write(c, 2, 0, 1, 4.0)


def test_a_write_past_the_cache_length_is_refused_before_any_block_is_taken():
    c = KVCache(2, 3, 2, 256, 8, torch.float32, num_blocks=9)
    with pytest.raises(ValueError, match="position 256 is past the KV cache length 256"):
        c.prepare_writes(torch.tensor([0, 1]), torch.tensor([[10], [256]]))
    assert c.pool.num_used == 0


def test_rows_see_their_own_blocks_in_any_pool_order():
    c = KVCache(1, 2, 1, 128, 4, torch.float32)
    for lo in range(0, 96, KV_BLOCK):  # interleaved: the rows' blocks alternate in the pool
        write(c, 0, lo, lo + KV_BLOCK, 1.0 + lo)
        write(c, 1, lo, lo + KV_BLOCK, -1.0 - lo)
    for r, sign in ((0, 1), (1, -1)):
        k = row_kv(c, r, 96)[0, 0, 0, :, 0]
        assert torch.equal(k, sign * (1.0 + torch.arange(96) // KV_BLOCK * KV_BLOCK).float())


def test_a_shared_prefix_block_is_copied_when_a_row_writes_into_it():
    c = KVCache(1, 2, 1, 128, 4, torch.float32)
    tokens = list(range(70))
    write(c, 0, 0, 70, 5.0)
    c.register_prefix(0, tokens)  # blocks 0 and 1 are full
    assert c.share_prefix(1, tokens + [7, 7], align=1) == 2 * KV_BLOCK
    assert c.blocks[1] == c.blocks[0][:2] and c.hits == 64 and c.queries == 72
    write(c, 1, 40, 41, 9.0)  # row 1 diverges inside the shared block 1: it gets its own copy
    assert c.blocks[1][1] != c.blocks[0][1] and c.blocks[1][0] == c.blocks[0][0]
    assert row_kv(c, 0, 70).eq(5.0).all()
    got = row_kv(c, 1, 41)[0, 0, 0, :, 0]
    assert got[:40].eq(5.0).all() and got[40] == 9.0


def slot_values(cache, row: int, length: int) -> torch.Tensor:
    """The first key component of slots ``[0, length)`` of ``row`` (layer 0, head 0)."""
    return row_kv(cache, row, length)[0, 0, 0, :, 0]


def test_a_write_the_pool_cannot_hold_takes_nothing_and_its_retry_maps_every_block():
    """Would have caught a failed allocation leaving the row half-mapped (issue 47, item 1): on a pool of
    4 blocks, with row 1 holding one, a 3-block write of row 0 raised NoFreeBlocks with blocks 2 and 3
    kept in the row's list but never entered in its table; once a block was freed the retry mapped
    only the third (``blocks=[2, 3, 1]``, ``table=[0, 0, 1, 0]``), so slots 0-63 of row 0 read and
    wrote the null block: every row's unmapped slots, silently shared."""
    c = KVCache(1, 2, 1, 128, 4, torch.float32, num_blocks=4)  # blocks 1..3
    write(c, 1, 0, 1, 7.0)  # row 1 takes one block
    with pytest.raises(NoFreeBlocks):
        write(c, 0, 0, 3 * KV_BLOCK, 1.0)
    assert c.blocks[0] == [] and c.table[0].eq(0).all() and c.pool.num_used == 1
    assert c.blocks_needed(0, 3 * KV_BLOCK) == 3
    c.free(1)
    idx = c.slot_index(torch.tensor([0]), torch.arange(3 * KV_BLOCK)[None])  # the retry
    x = torch.arange(3 * KV_BLOCK, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 4)  # slot s holds s
    c.write(0, idx, x, x)
    assert c.table[0, :3].tolist() == c.blocks[0] and sorted(c.blocks[0]) == [1, 2, 3]
    assert torch.equal(slot_values(c, 0, 3 * KV_BLOCK), torch.arange(3 * KV_BLOCK, dtype=torch.float32))
    assert c.k[:, 0].eq(0).all()  # the null block is still all zeros


def test_copy_on_write_is_budgeted_and_a_pool_one_block_short_refuses_the_whole_write():
    """Would have caught copy-on-write missing from the budget (issue 47, item 1): two rows share a
    prompt's blocks (identical prompts in flight), and row 1's next write falls into the shared
    partial block and one block past it. ``blocks_needed`` counted 1 (the new block) where the write
    takes 2 (a copy too), so on a pool exactly one block short the engine saw room, and the write took
    the new block, then failed on the copy with the new block kept."""
    c = KVCache(1, 2, 1, 128, 4, torch.float32, num_blocks=4)  # blocks 1..3
    write(c, 0, 0, 40, 5.0)  # row 0: blocks 1 and 2 (slots 32..39 of the second)
    c.share_row(0, 1, 40)
    assert c.blocks[1] == c.blocks[0] and c.pool.num_free == 1
    assert c.blocks_needed(1, 70) == 1  # mapping alone
    assert c.blocks_needed(1, 70, start=40) == 2  # the new block and a copy of the shared one
    assert c.blocks_needed(1, 64, start=40) == 1  # a copy only
    assert c.blocks_needed(1, 40, start=0) == 2  # both shared blocks
    before = (list(c.blocks[1]), c.table.clone(), list(c.pool.ref), c.pool.num_free)
    with pytest.raises(NoFreeBlocks):
        write(c, 1, 40, 70, 9.0)
    assert (list(c.blocks[1]), list(c.pool.ref), c.pool.num_free) == (before[0], before[2], before[3])
    assert torch.equal(c.table, before[1])
    c.grow(2, 128, num_blocks=5)  # the one block more
    write(c, 1, 40, 70, 9.0)
    assert c.pool.num_free == 0 and c.blocks[1][0] == c.blocks[0][0] and c.blocks[1][1] != c.blocks[0][1]
    assert slot_values(c, 0, 40).eq(5.0).all()
    got = slot_values(c, 1, 70)
    assert got[:40].eq(5.0).all() and got[40:].eq(9.0).all()


def test_rows_writing_into_one_shared_block_take_one_copy_between_them():
    """The all-or-nothing check counts exactly what the writes take: when both rows sharing a block
    write into it in one call, the first copies it and the second then holds it alone, so one free
    block is enough (one copy per writer would refuse a write that fits)."""
    c = KVCache(1, 2, 1, 128, 4, torch.float32, num_blocks=4)
    write(c, 0, 0, 40, 5.0)
    c.share_row(0, 1, 40)
    assert c.pool.num_free == 1
    c.prepare_writes(torch.tensor([0, 1]), torch.tensor([[40], [40]]))
    assert c.pool.num_free == 0 and c.blocks[0][1] != c.blocks[1][1] and c.blocks[0][0] == c.blocks[1][0]
    assert c.table[0, :2].tolist() == c.blocks[0] and c.table[1, :2].tolist() == c.blocks[1]


def test_share_prefix_cuts_to_the_alignment_and_stops_at_the_first_miss():
    c = KVCache(1, 3, 1, 256, 4, torch.float32)
    tokens = list(range(200))
    write(c, 0, 0, 200, 1.0)
    c.register_prefix(0, tokens)
    assert c.share_prefix(1, tokens, align=80) == 160  # 6 blocks hit (192 slots), cut to 2 x 80
    assert len(c.blocks[1]) == 5
    other = tokens[:40] + [999] + tokens[41:]
    assert c.share_prefix(2, other, align=1) == KV_BLOCK  # block 1 differs: only block 0


def test_cached_blocks_outlive_their_row_and_are_evicted_least_recently_used_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    ka, kb = block_hashes(list(range(64)), KV_BLOCK)
    pool.register(a, ka)
    pool.register(b, kb)
    for x in (b, a, c):
        pool.release(x)
    assert pool.num_free == 3 and pool.match([ka, kb]) == [a, b]
    assert pool.allocate() == c  # an empty block before any cached one
    assert pool.allocate() == b  # then the least recently freed cached block, forgotten
    assert pool.match([ka, kb]) == [a]
    pool.hold(a)  # a hit takes it out of the LRU list
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_a_freed_empty_block_is_the_next_one_taken():
    """Would have caught the pool cycling through every block (issue 33): a queue handed out block 4 here,
    then 5, ..., first-touching the whole KV budget over a long run instead of reusing what was freed."""
    pool = BlockPool(8)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (1, 2, 3)  # a fresh pool hands out its lowest blocks first
    pool.release(b)
    assert pool.allocate() == b  # the block just freed, not a never-used one
    pool.release(a)
    pool.release(c)
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [c, a, 4]  # last freed first, then new ones
    pool.grow(10)
    pool.release(a)
    assert [pool.allocate() for _ in range(5)] == [a, 5, 6, 7, 8]  # grown blocks come after the pool's own
    key = block_hashes(list(range(KV_BLOCK)), KV_BLOCK)[0]
    pool.register(c, key)
    pool.release(c)  # a cached prefix: kept, taken only when no empty block is left
    pool.release(a)
    assert pool.allocate() == a and pool.allocate() == 9 and pool.allocate() == c and pool.match([key]) == []


def test_a_cache_serving_many_short_requests_keeps_using_the_same_blocks():
    """Would have caught the resident memory climbing to the whole KV budget: 300 rounds of 4 rows each
    writing a 2-block request and freeing it must touch only the 8 blocks of one round (the queue touched
    all 200 of the pool)."""
    c = KVCache(1, 4, 1, 64, 4, torch.float32, num_blocks=201)
    touched = set()
    for i in range(300):
        for row in range(4):
            write(c, row, 0, 40, float(i))
            touched.update(c.blocks[row])
        for row in range(4):
            c.free(row)
    assert len(touched) == 8 and c.pool.num_used == 0


def test_block_hashes_chain_the_whole_prefix():
    x = block_hashes(list(range(96)), KV_BLOCK)
    y = block_hashes([5] + list(range(1, 96)), KV_BLOCK)
    assert len(x) == 3 and all(a != b for a, b in zip(x, y))  # one token early changes every later key
    assert block_hashes(list(range(95)), KV_BLOCK) == x[:2]


def test_grow_keeps_rows_and_blocks():
    c = KVCache(1, 1, 1, 32, 4, torch.float32)
    write(c, 0, 0, 20, 3.0)
    c.grow(4, 300)
    assert c.rows == 4 and c.max_len == 320 and c.num_blocks == 4 * 10 + 1
    assert row_kv(c, 0, 20).eq(3.0).all()


def test_memory_budgets_are_bytes_or_a_fraction_of_the_machine():
    from specdec.runtime.kv_cache import memory_bytes
    assert memory_bytes("2GB") == 2 * 10**9 and memory_bytes("512MiB") == 512 * 2**20 and memory_bytes(4096) == 4096
    assert 0 < memory_bytes(0.25) < memory_bytes(None) < memory_bytes("0.5")
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(ValueError):
            memory_bytes(bad)


# ---- the windowed group (sliding-window layers' keys) ------------------------------------------------
def windowed(window: int = 40, rows: int = 2, max_len: int = 1024):
    """A cache of one global layer with a windowed group of one layer beside it, as Transformer.new_cache makes."""
    c = KVCache(1, rows, 1, max_len, 4, torch.float32)
    c.local = KVCache(1, rows, 1, max_len, 4, torch.float32, window=window)
    return c


def write_both(cache, row, lo, hi, value):
    write(cache, row, lo, hi, value)  # maps both groups (prepare_writes)
    write(cache.local, row, lo, hi, value)


def test_a_windowed_group_frees_what_left_the_window_and_keeps_the_window():
    c = windowed(window=40)
    bound = blocks_for(40 + WINDOW_SLACK) + 2
    for lo in range(0, 800, 8):  # a prompt in chunks of 8, then on
        write_both(c, 0, lo, lo + 8, lo)
        assert c.local.pool.num_used <= bound, lo
    assert c.pool.num_used == blocks_for(800)  # the global layer keeps every key
    assert c.local.table[0, :blocks_for(800 - 40 - WINDOW_SLACK) - 1].eq(0).all()
    # the keys of the window before slot 800 are intact
    keys = row_kv(c.local, 0, 800)[0, 0, 0, 800 - 40 - WINDOW_SLACK:, 0]
    want = torch.arange(800 - 40 - WINDOW_SLACK, 800) // 8 * 8
    assert torch.equal(keys, want.float())
    c.free(0)
    assert c.local.pool.num_used == 0 and c.pool.num_used == 0


def test_a_windowed_row_may_step_back_within_the_slack_but_never_reads_freed_keys():
    c = windowed(window=40)
    write_both(c, 0, 0, 600, 1.0)
    for lo in range(600, 700, 4):
        write_both(c, 0, lo, lo + 4, 1.0)
    write_both(c, 0, 700 - WINDOW_SLACK, 701, 2.0)  # back by the slack: its window's keys are still held
    with pytest.raises(ValueError, match="were freed"):
        c.prepare_writes(torch.tensor([0]), torch.arange(400, 404)[None])
    assert c.holds_end(0, 690) and not c.holds_end(0, 400)
    write_both(c, 0, 0, 64, 3.0)  # the row again from position 0 (a drafter's new context): nothing before it is read
    assert torch.equal(row_kv(c.local, 0, 64)[0, 0, 0, :, 0], torch.full((64,), 3.0))


def test_a_cached_prefix_maps_the_windowed_keys_of_its_end_only():
    c = windowed(window=40)
    prompt = list(range(300))
    write_both(c, 0, 0, 300, 5.0)
    c.register_prefix(0, prompt)
    n = c.share_prefix(1, prompt + [7, 8], 32)
    assert n == 288  # every full block of the prompt, cut to the alignment
    first = (288 - 40 + 1) // KV_BLOCK
    assert c.local.blocks[1][:first] == [0] * first and all(c.local.blocks[1][first:])
    assert c.local.blocks[1][first:] == c.local.blocks[0][first:blocks_for(288)]
    write_both(c, 1, 288, 302, 6.0)  # the row prefills the rest: the shared partial block is copied first
    assert torch.equal(row_kv(c.local, 0, 300)[0, 0, 0, 250:, 0], torch.full((50,), 5.0))
    # the windowed blocks of the prompt's end evicted (freed, then taken by another row): no prefix hit
    c.free(0)
    c.free(1)
    for b in list(c.local.pool.key_of):
        c.local.pool.unregister(b)
    assert c.share_prefix(1, prompt, 32) == 0


def test_the_later_parts_of_one_forward_free_nothing_its_first_part_writes_or_reads():
    """Issue 59 (1): a forward of several parts (a grouped prefill's chunks) maps each with a call of its own before
    any computes; a later part's call freed the windowed blocks the first part was about to write and read. With
    ``since`` (the forward's first slot) every later part keeps them; a forward without it still frees them."""
    for since in (None, {0: 320}):
        c = windowed(window=40)
        write_both(c, 0, 0, 320, 1.0)
        for lo in range(320, 320 + 512, 32):  # 16 chunks of one forward
            c.prepare_writes(torch.tensor([0]), torch.arange(lo, lo + 32)[None], since)
        needed = range((320 - 40 + 1) // KV_BLOCK, blocks_for(320 + 512))  # the first chunk's window on
        assert all(c.local.blocks[0][i] for i in needed) == (since is not None)
    # the forward after: trimmed behind its own first slot
    c.prepare_writes(torch.tensor([0]), torch.arange(832, 833)[None])
    assert c.local.blocks[0][(832 - 40 + 1 - WINDOW_SLACK) // KV_BLOCK - 1] == 0
