"""Prompt files for `specdec bench`: Spec-Bench and raw records, validation errors naming the line."""
from __future__ import annotations

import json

import pytest

from specdec.tools.bench.prompts import default_prompts_path, load_prompts, parse_categories, read_prompt_file, select
from specdec.cli import main
from specdec.errors import SpecdecError


def write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_spec_bench_and_raw_records(tmp_path):
    p = write(tmp_path / "q.jsonl", [
        {"question_id": 81, "category": "coding", "turns": ["Write a loop.", "Now in C."]},
        "",
        {"question_id": 82, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        {"prompt": "def f(x):"},
        {"question_id": 83, "category": "writing", "turns": ["A poem."]},
    ])
    items = read_prompt_file(p)
    assert [i.category for i in items] == ["mt-bench", "qa", "default", "mt-bench"]
    assert items[0].subcategory == "coding" and items[0].turns == ("Write a loop.", "Now in C.")
    assert items[2].prompt == "def f(x):" and not items[2].is_chat
    one = select(items, ["mt-bench", "default"], limit=1)
    assert [(i.index, i.question_id) for i in one] == [(0, "81"), (1, "4")]


def test_limit_takes_folded_subcategories_in_turn(tmp_path):
    recs = [{"question_id": q, "category": c, "turns": ["x"]}
            for q, c in [(1, "writing"), (2, "writing"), (3, "roleplay"), (4, "roleplay"), (5, "qa"), (6, "qa")]]
    items = read_prompt_file(write(tmp_path / "q.jsonl", recs))
    assert [i.question_id for i in select(items, None, 2)] == ["1", "3", "5", "6"]
    assert [i.question_id for i in select(items)] == ["1", "3", "2", "4", "5", "6"]


def test_default_prompt_set_is_packaged():
    items = load_prompts()
    cats = {i.category for i in items}
    assert default_prompts_path().is_file() and 12 <= len(items) <= 20
    assert {"code", "chat", "summarization", "structured"} <= cats


@pytest.mark.parametrize("line, needle", [
    ("{not json", "line 2: not valid JSON"),
    (json.dumps({"category": "qa"}), "line 2: a record needs 'turns'"),
    (json.dumps({"turns": "hello"}), "line 2: 'turns' must be a non-empty list"),
    (json.dumps({"turns": ["ok", 3]}), "line 2: 'turns' must be a non-empty list"),
    (json.dumps({"prompt": 42}), "line 2: 'prompt' must be a non-empty string"),
    (json.dumps({"prompt": "x", "category": 7}), "line 2: 'category' must be a non-empty string"),
    (json.dumps(["a list"]), "line 2: a record must be a JSON object"),
])
def test_malformed_lines_name_the_line(tmp_path, line, needle):
    p = write(tmp_path / "bad.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(SpecdecError, match=needle.replace("(", r"\(")):
        read_prompt_file(p)


def test_selection_errors(tmp_path):
    items = read_prompt_file(write(tmp_path / "q.jsonl", [{"prompt": "a", "category": "x"}]))
    with pytest.raises(SpecdecError, match="unknown category 'y': the prompts have x"):
        select(items, ["y"])
    with pytest.raises(SpecdecError, match="--limit must be at least 1"):
        select(items, None, 0)
    with pytest.raises(SpecdecError, match="holds no records"):
        read_prompt_file(write(tmp_path / "empty.jsonl", [""]))
    assert parse_categories(" a, b ,") == ["a", "b"] and parse_categories(None) is None


@pytest.mark.parametrize("args, needle", [
    (["--prompts", "/nonexistent/q.jsonl"], "does not exist"),
    (["--prompts", "BAD"], "line 2: not valid JSON"),
    (["--categories", "nope"], "unknown category 'nope': the prompts have code, chat"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be from 1 to 32"),
    (["--speculative-model", None], "nothing to compare"),
    (["--speculative-model", None, "--speculative-method", "draft_model"], "needs 'model'"),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, args, needle):
    """All checked before any model loads (the model name is never resolved)."""
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, "{oops"])
    argv = ["bench", "--model", "no-such-model", "--speculative-model", "d", "--output", str(tmp_path / "r.json")]
    if args[:2] == ["--speculative-model", None]:
        argv = argv[:3] + argv[5:] + args[2:]
    else:
        argv += [str(bad) if a == "BAD" else a for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err
