"""One progress line per model: phases share one bar, which ends with what each took."""
from __future__ import annotations

from specdec.models.progress import ModelProgress


def test_phases_fill_one_bar_and_the_summary_names_them(capsys):
    with ModelProgress("m", enabled=True) as bar:
        bar.phase("download", 2)
        bar.downloaded = 2_000_000_000
        bar.advance(1)
        bar.advance(1)
        bar.phase("check", 10, "checking")
        bar.advance(10)
        bar.phase("convert", 4)
        bar.advance(4)
    summary = bar.summary()  # after close: every phase ended
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip("\n").split("\r")[-1].startswith("m: 100%")
    assert summary.startswith("ready in ") and "download 2.0 GB" in summary
    assert "check" in summary and "convert" in summary


def test_a_skipped_phase_counts_as_done_and_a_failure_leaves_the_bar_where_it_stopped(capsys):
    bar = ModelProgress("m", enabled=True)
    bar.phase("convert", 10)  # the GGUF was already cached: download and check skipped
    bar.advance(5)
    bar.close(ok=False)
    last = capsys.readouterr().err.rstrip("\n").split("\r")[-1]
    assert last.startswith("m:  78%"), last  # 0.45 + 0.10 + 0.45 / 2


def test_disabled_prints_nothing_but_keeps_timings(capsys):
    bar = ModelProgress("m", enabled=False)
    bar.phase("download", 1)
    bar.advance(1)
    bar.close()
    assert capsys.readouterr().err == "" and set(bar.seconds) == {"download"}
