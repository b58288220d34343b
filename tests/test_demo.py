"""`specdec demo` on tiny models: the lines a person reads, and the identical-tokens check."""
from __future__ import annotations

import pytest

from specdec import cli
from specdec.demo import DraftMarks, demo_config, highlighted
from specdec.proposers.registry import METHODS, schema


def run_demo(capsys, *args: str) -> tuple[int, list[str]]:
    rc = cli.main(["demo", *args])
    return rc, capsys.readouterr().out.splitlines()


def test_demo_prints_prompt_models_method_answer_speeds_and_the_identical_check(tiny_model_dir, capsys):
    rc, lines = run_demo(capsys, "--model", str(tiny_model_dir), "--draft", str(tiny_model_dir),
                         "--draft-quantization", "none", "-k", "3", "--prompt", "def fibonacci(n):",
                         "--max-tokens", "12")
    assert rc == 0, lines
    text = "\n".join(lines)
    assert lines[0] == "prompt:       def fibonacci(n):"
    assert lines[1] == f"models:       target {tiny_model_dir} (bfloat16), draft {tiny_model_dir} (bfloat16)"
    assert lines[2].startswith("method:       draft_model: ")
    assert lines[3].startswith("settings:     num_speculative_tokens=3, adaptive=False, ") and "model=" in lines[3]
    assert "answer:" in lines and ("[cut at --max-tokens: raise it to see the rest]" in lines
                                   or "[end of the answer]" in lines)
    for label in ("plain:", "speculative:", "speedup:", "acceptance:", "tokens/step:", "identical:"):
        assert sum(ln.startswith(label) for ln in lines) == 1, (label, text)
    assert "identical:    yes" in text and "tok/s" in text
    assert "100% of" in text  # the draft is the target itself: every drafted token is accepted
    assert "4.00 per target forward pass" in text or "[end of the answer]" in lines


def test_demo_tries_another_method_without_a_draft_model(tiny_model_dir, capsys):
    rc, lines = run_demo(capsys, "--model", str(tiny_model_dir), "--method", "ngram", "--prompt",
                         "a b c a b c a b c", "--max-tokens", "8")
    assert rc == 0 and lines[1].endswith("; no second model") and lines[2].startswith("method:       ngram: ")
    assert "identical:    yes" in "\n".join(lines)


def test_bad_demo_options_fail_before_loading(capsys):
    assert cli.main(["demo", "--model", "no-such-model", "-k", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "num_speculative_tokens" in err and err.count("\n") == 1


@pytest.mark.parametrize("method", list(METHODS))
def test_demo_config_is_valid_for_every_method(method):
    cfg = demo_config(method, "draft", "int4", 4)
    schema(method).parse({k: v for k, v in cfg.items() if k != "method"})
    names = {f.name for f in schema(method).fields()}
    assert ("model" in cfg) == ("model" in names)


def test_draft_marks_split_each_step_into_accepted_drafts_and_the_targets_token(tiny_model_dir):
    from specdec.formats.tokenizer import Tokenizer

    class Seq:
        output_ids: list[int] = []
        num_accepted = 0

    marks, s = DraftMarks(), Seq()
    for new, acc in ((1, 0), (4, 3), (2, 1), (1, 0)):  # prefill, then steps accepting 3, 1 and 0 drafts
        s.output_ids = s.output_ids + [5] * new
        s.num_accepted += acc
        marks([s])
    assert marks.from_draft == [False, True, True, True, False, True, False, False]
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("def fibonacci(n): return n")
    flags = [i % 2 == 0 for i in range(len(ids))]
    text = tok.decode(ids)
    rich_text = highlighted(tok, ids, flags, text)
    assert rich_text.plain == text
    assert any(span.style for span in rich_text.spans)
    assert highlighted(tok, ids, flags, text[:5]).plain == text[:5]  # a stop string cut the text
