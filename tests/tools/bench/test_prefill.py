"""`python -m specdec.tools.bench.prefill`: our prefill of exactly N tokens (and llama.cpp's ppN beside it), on a
tiny model; bad input in one line."""
from __future__ import annotations

import pytest

from test_bench_long import model  # noqa: F401  (the tiny model with a 1024-token context)
from specdec.tools.bench import prefill


def test_our_prefill_of_each_length_is_timed_alone_without_llamacpp(model, capsys, monkeypatch):
    seen = []
    real = prefill.ours
    monkeypatch.setattr(prefill, "ours", lambda llm, n, styles: seen.append((n, styles)) or real(llm, n, styles))
    assert prefill.main(["--model", str(model), "--lengths", "300,256", "--styles", "rag", "--llamacpp", "none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == [(256, ("rag",)), (300, ("rag",))]  # sorted lengths, one prompt each of the styles asked
    assert out[0].startswith("| prompt tokens |") and out[2].startswith("| 256 | ") and out[3].startswith("| 300 | ")
    assert out[2].endswith("| - | - |")  # no llama.cpp: no ratio


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "100"], "--lengths: a long prompt needs at least 256 tokens, got 100"),
    (["--styles", "poem"], "--styles: unknown long-prompt style 'poem'"),
    (["--llamacpp", "/nonexistent"], "no llama-bench in /nonexistent"),
])
def test_bad_input_is_one_line_and_exit_2(model, argv, message, capsys):
    assert prefill.main(["--model", str(model), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
