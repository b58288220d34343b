"""`specdec bench --long` end to end on a tiny random-weight model: the JSONL of measurements (plain first,
then the drafter, outputs checked equal), both plots, a rerun that measures nothing new, a stopped run that
resumes, and bad inputs that end in one line of error and a non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_model_dir
from specdec.cli import build_parser, main
from specdec.tools.bench import long_context

PNG = b"\x89PNG\r\n\x1a\n"
LENGTHS = [256, 320]
STYLES = ["summarization", "rag", "code"]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model with a 1024-token context (its config raised after it is written)."""
    d = make_model_dir(tmp_path_factory.mktemp("long") / "model")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 1024}))
    return d


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("short") / "model")  # a 256-token context


def bench_long(model, out, *extra):
    return main(["bench", "--long", "--model", str(model), "--dtype", "float32", "--speculative-method", "ngram",
                 "--num-speculative-tokens", "3", "--max-tokens", "6", "--output", str(out), "--no-progress", *extra])


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def valid_png(path: Path) -> bool:
    from PIL import Image
    with Image.open(path) as im:
        im.verify()
    return path.read_bytes()[:8] == PNG


def test_long_bench_measures_every_prompt_plain_first_plots_and_resumes(model, tmp_path, capsys, monkeypatch):
    out, plots = tmp_path / "res" / "long.jsonl", tmp_path / "plots"
    rc = bench_long(model, out, "--lengths", ",".join(map(str, LENGTHS)), "--plots", str(plots))
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rows = rows_of(out)
    assert [(r["prompt"], r["config"]) for r in rows] == [
        (f"{s}-{n}", c) for n in LENGTHS for s in STYLES for c in ("plain", "ngram K=3")]
    for r in rows:
        assert abs(r["prompt_tokens"] - r["length"]) <= 2 and r["generated"] == 6
        assert r["model"] == str(model) and r["max_tokens"] == 6 and r["style"] == r["prompt"].rsplit("-", 1)[0]
        if r["config"] == "plain":
            assert len(r["tokens"]) == 6 and r["spec"] is None
        else:
            assert r["mismatch"] is False and r["spec"]["method"] == "ngram" and r["drafted"] > 0
    # progress on stderr as each prompt goes, the table on stdout
    assert "[1/6] summarization-256: measuring plain, ngram K=3" in cap.err and "[6/6] code-320" in cap.err
    assert "code-320      ngram K=3: prefill" in cap.err
    assert "| drafter | 256 tokens | 320 tokens |" in cap.out and "| ngram K=3 |" in cap.out
    assert "MISMATCH" not in cap.out + cap.err and f"wrote {out}" in cap.out
    assert sorted(p.name for p in plots.iterdir()) == sorted(long_context.PLOTS)
    assert all(valid_png(plots / n) for n in long_context.PLOTS)

    # a rerun measures nothing (and loads no model), yet reports and plots again
    before = out.read_text()
    for p in plots.iterdir():
        p.unlink()

    def no_model(*args, **kwargs):
        raise AssertionError("a rerun with everything measured loaded the model")
    import specdec.llm
    with monkeypatch.context() as m:
        m.setattr(specdec.llm, "LLM", no_model)
        assert bench_long(model, out, "--lengths", "320,256", "--plots", str(plots)) == 0
    cap = capsys.readouterr()
    assert out.read_text() == before
    assert "nothing to measure: all 12 measurements are in" in cap.err and "| ngram K=3 |" in cap.out
    assert sorted(p.name for p in plots.iterdir()) == sorted(long_context.PLOTS)

    # a stopped run (its last three measurements lost) resumes with those three only
    lines = before.splitlines(keepends=True)
    out.write_text("".join(lines[:-3]))
    measured = []
    real = long_context.measure

    def counting(llm, text, params):
        measured.append(llm.speculative.method if llm.speculative else "plain")
        return real(llm, text, params)
    monkeypatch.setattr(long_context, "measure", counting)
    assert bench_long(model, out, "--lengths", "256,320") == 0
    err = capsys.readouterr().err
    assert measured == ["ngram", "plain", "ngram"]  # rag-320's drafter, then code-320's plain and drafter
    assert "3 of 12 measurements to run (9 already in" in err
    assert "[1/2] rag-320: measuring ngram K=3" in err and "[2/2] code-320: measuring plain, ngram K=3" in err
    assert [(r["prompt"], r["config"]) for r in rows_of(out)] == [(r["prompt"], r["config"]) for r in rows]


def test_a_drafter_output_differing_from_plain_exits_1(model, tmp_path, capsys):
    out = tmp_path / "long.jsonl"
    assert bench_long(model, out, "--lengths", "256", "--styles", "rag") == 0
    rows = rows_of(out)
    rows[0]["tokens"][2] += 1  # plain's recorded answer: the resumed drafter's no longer equals it
    out.write_text(json.dumps(rows[0]) + "\n")
    capsys.readouterr()
    assert bench_long(model, out, "--lengths", "256", "--styles", "rag") == 1
    cap = capsys.readouterr()
    assert "ERROR: 1 greedy output(s) differ from plain decoding" in cap.out and "MISMATCH" in cap.err
    assert rows_of(out)[-1]["mismatch"] is True


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "100"], "--lengths: a long prompt needs at least 256 tokens, got 100"),
    (["--lengths", "2k"], "--lengths takes token counts separated by commas (e.g. 2048,8192), got '2k'"),
    (["--styles", "rag,poem"], "--styles: unknown long-prompt style 'poem': one or more of summarization, rag, code"),
    (["--lengths", "512", "--max-model-len", "300"],
     "--lengths 512 with --max-tokens 6 needs 520 tokens of context, above --max-model-len 300"),
    (["--prompts", "packaged"], "--prompts does not go with --long"),
    (["--temperature", "0.7"], "--long measures greedy decoding"),
])
def test_bad_inputs_are_one_line_errors(extra, message, short_model, tmp_path, capsys):
    assert bench_long(short_model, tmp_path / "o.jsonl", *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_length_beyond_the_model_context_is_an_error(short_model, tmp_path, capsys):
    assert bench_long(short_model, tmp_path / "o.jsonl", "--lengths", "512") == 2
    err = capsys.readouterr().err
    assert "error: --lengths 512 with --max-tokens 6 needs 520 tokens of context, above the model's 256: " \
           "drop the longer lengths\n" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_lengths_without_long_and_a_results_file_of_another_run_are_errors(model, tmp_path, capsys):
    assert main(["bench", "--model", str(model), "--speculative-method", "ngram", "--lengths", "2048"]) == 2
    assert "error: --lengths goes with --long (long prompts): add --long, or drop --lengths" in capsys.readouterr().err
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"prompt": "rag-256", "config": "plain", "model": "another", "max_tokens": 6}) + "\n")
    assert bench_long(model, out, "--lengths", "256") == 2
    assert f"error: --output {out} holds measurements with model 'another'" in capsys.readouterr().err
    out.write_text(json.dumps({"prompt": "rag-256", "config": "ngram K=3", "spec": {"method": "ngram"}}) + "\n")
    assert bench_long(model, out, "--lengths", "256") == 2
    assert "holds 'ngram K=3' measured with another speculative config" in capsys.readouterr().err


def test_the_command_line_says_no_traceback_and_exits_nonzero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--long", "--model", "unused",
                           "--speculative-method", "ngram", "--lengths", "2048,64", "--output", str(tmp_path / "o")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "error: --lengths: a long prompt needs at least 256 tokens, got 64\n"


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "2048,64"], "--lengths: a long prompt needs at least 256 tokens, got 64"),
    (["--styles", "poem"], "--styles: unknown long-prompt style 'poem'"),
    (["--model", "no-such-model"], "no-such-model"),
])
def test_the_module_entry_point_says_bad_input_in_one_line(extra, message, tmp_path, capsys):
    """``python -m specdec.tools.bench.long_context``: bad input is one line and exit 2 (it was a traceback)."""
    argv = ["--model", "unused", "--out", str(tmp_path / "o.jsonl"), "--lengths", "512", *extra]
    assert long_context.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_help_mentions_long():
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")
    text = sub.choices["bench"].format_help()
    assert "--long: long prompts instead" in text and "--lengths N,N" in text and "--styles S,S" in text
