"""Progress on a terminal (one redrawn bar per model) and in a log (whole lines, no carriage returns)."""
from __future__ import annotations

import io

from specdec.formats.progress import ModelProgress, _line_bar_class, bar


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def run_phases(progress: ModelProgress) -> None:
    with progress as b:
        b.phase("download", 2)
        b.downloaded = 2_000_000_000
        b.advance(1)
        b.advance(1)
        b.phase("check", 10, "checking")
        b.advance(10)
        b.phase("convert", 4)
        b.advance(4)


def test_on_a_terminal_phases_fill_one_bar_and_the_summary_names_them():
    out = Terminal()
    progress = ModelProgress("m", enabled=True, file=out)
    run_phases(progress)
    summary = progress.summary()  # after close: every phase ended
    text = out.getvalue()
    assert text.count("\n") == 1 and text.rstrip("\n").split("\r")[-1].startswith("m: 100%")
    assert summary.startswith("ready in ") and "download 2.0 GB" in summary
    assert "check" in summary and "convert" in summary


def test_in_a_log_each_phase_is_one_line_and_there_is_no_carriage_return():
    out = io.StringIO()  # a file or a pipe: not a terminal
    run_phases(ModelProgress("m", enabled=True, file=out))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[:3] == ["m: download", "m: checking", "m: convert"]
    assert len(lines) == 4 and lines[3].startswith("m: ready in ") and "download 2.0 GB" in lines[3]


def test_a_phase_entered_twice_adds_up_and_is_one_line_in_a_log():
    out = io.StringIO()
    with ModelProgress("m", enabled=True, file=out) as b:
        b.phase("convert", 1, "reading")
        b.phase("convert", 4)
    assert out.getvalue().splitlines()[0] == "m: reading" and len(out.getvalue().splitlines()) == 2
    assert list(b.seconds) == ["convert"]


def test_a_skipped_phase_counts_as_done_and_a_failure_leaves_the_bar_where_it_stopped():
    out = Terminal()
    b = ModelProgress("m", enabled=True, file=out)
    b.phase("convert", 10)  # the GGUF was already cached: download and check skipped
    b.advance(5)
    b.close(ok=False)
    last = out.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("m:  78%"), last  # 0.45 + 0.10 + 0.45 / 2
    log = io.StringIO()
    b = ModelProgress("m", enabled=True, file=log)
    b.phase("check", 10)
    b.close(ok=False)
    assert log.getvalue().splitlines() == ["m: check", "m: stopped during check"]


def test_disabled_prints_nothing_but_keeps_timings(capsys):
    b = ModelProgress("m", enabled=False)
    b.phase("download", 1)
    b.advance(1)
    b.close()
    assert capsys.readouterr().err == "" and set(b.seconds) == {"download"}


def test_a_bar_in_a_log_writes_a_line_per_tenth_and_no_carriage_return():
    out = io.StringIO()
    b = bar(total=1000, desc="train", unit="tok", file=out, mininterval=0, dynamic_ncols=True)
    for _ in range(100):
        b.update(10)
        b.set_postfix(loss="1.000")
    b.close()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # the start, each tenth (10%, ..., 100%), and the final line with the totals
    assert len(lines) == 12, lines
    assert lines[0].startswith("train:   0%") and lines[-1].startswith("train: 100%")


def test_a_bar_on_a_terminal_is_tqdms_own_and_leave_false_clears_nothing_in_a_log():
    out = Terminal()
    b = bar(total=4, desc="x", file=out, mininterval=0)
    b.update(4)
    b.close()
    assert "\r" in out.getvalue()
    log = io.StringIO()
    for i in bar(range(3), desc="y", leave=False, file=log, mininterval=0):
        if i == 1:
            _line_bar_class().write("a message between the lines", file=log)  # tqdm.write: clears bars
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    assert "a message between the lines\n" in log.getvalue()


def test_a_bar_without_a_total_in_a_log_writes_its_start_and_its_end():
    out = io.StringIO()
    b = bar(desc="regenerate", unit="reply", file=out, mininterval=0, every=3600)
    b.update(3)
    b.set_postfix(tokens=42)
    b.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0].startswith("regenerate: 0") and lines[1].startswith("regenerate: 3")
