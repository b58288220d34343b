"""The native forward's scratch buffer (models/native.py ``_Work``): grown on demand, reused under a
steady load, and given back when it has stayed far larger than needed (or on ``trim()``)."""
from specdec.models.native import _Work

MB = 1 << 20


def test_the_scratch_shrinks_after_a_long_context_request_ends():
    """Before, the buffer only grew: one 128k-key request left ~1 GB of scratch (many threads) pinned
    for the process's life, however short every later request was."""
    w = _Work()
    big = w.get(400 * MB).numel()
    assert big >= 400 * MB
    for _ in range(_Work.SHRINK_AFTER - 1):  # short steps: kept for a while (a burst does not thrash it)
        assert w.get(2 * MB).numel() == big
    w.get(3 * MB)  # the SHRINK_AFTER-th small call in a row: sized for the largest of them
    assert 3 * MB <= w.buf.numel() < 4 * MB + 4096


def test_a_steady_load_allocates_nothing_per_call():
    w = _Work()
    buf = w.get(10 * MB)
    for i in range(10 * _Work.SHRINK_AFTER):
        assert w.get((6 + i % 5) * MB) is buf  # within a quarter of the buffer: never reallocated
    for i in range(3 * _Work.SHRINK_AFTER):  # small needs broken by a large one before SHRINK_AFTER: kept
        assert w.get(12 * MB if i % (_Work.SHRINK_AFTER // 2) == 0 else MB).numel() >= 12 * MB


def test_trim_gives_the_buffer_back_and_the_next_call_regrows_it():
    w = _Work()
    w.get(50 * MB)
    w.trim()
    assert w.buf.numel() == 0
    assert w.get(MB).numel() >= MB
