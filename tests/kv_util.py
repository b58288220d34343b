"""Reading a paged KV cache row by row, for tests that compare caches."""
import torch


def row_kv(cache, row: int, length: int) -> torch.Tensor:
    """Keys then values of slots ``[0, length)`` of ``row``, every layer: ``(2, layers, H, length, D)``."""
    at = cache.gather_index(torch.tensor([row]), length)
    layers = [torch.stack([x[0] for x in cache.read(i, at)]) for i in range(cache.k.shape[0])]
    return torch.stack(layers, dim=1)


def same_rows(a, b, rows: dict[int, int]) -> bool:
    """Caches ``a`` and ``b`` hold the same bits in the first ``rows[r]`` slots of each row ``r``."""
    return all(torch.equal(row_kv(a, r, n), row_kv(b, r, n)) for r, n in rows.items())
