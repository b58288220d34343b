"""Training reports: the head's training curve from a checkpoint history."""
from __future__ import annotations

import pytest

from specdec.train.report import plot_training


@pytest.mark.parametrize("measured", [True, False], ids=["with-acceptance", "loss-only"])
def test_the_training_curve_draws_any_history(tmp_path, measured):
    history = [{"step": s, "tokens": 1000 * s, "seconds": s, "loss": 5.0 / s, "top1": [0.1 * s, 0.05 * s]}
               | ({"mean_accepted_length": 1 + 0.1 * s} if measured and s % 2 else {}) for s in range(1, 6)]
    final = {"mean_accepted_length": 1.7, "eval_prompts": 4, "k": 5} if measured else None
    path = plot_training(history, tmp_path / "plots" / "training.png", "test", final)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
