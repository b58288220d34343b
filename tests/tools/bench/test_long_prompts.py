"""Long prompts from docstrings: the length asked for (in the model's tokens, chat template included),
the same prompt twice, the RAG question about a passage the prompt holds, clear errors."""
from __future__ import annotations

import pytest

from conftest import make_model_dir
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer
from specdec.tools.bench.long_prompts import long_prompt, long_prompts, write_jsonl
from specdec.tools.bench.prompts import read_prompt_file

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(make_model_dir(tmp_path_factory.mktemp("lp") / "model"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A small 'standard library': 30 modules, each with a module docstring and three documented functions."""
    root = tmp_path_factory.mktemp("stdlib")
    for m in range(30):
        lines = [f'"""Module {m}: ' + " ".join(WORDS[(m + i) % len(WORDS)] for i in range(30)) + '"""']
        for f in range(3):
            doc = " ".join(WORDS[(m * f + i) % len(WORDS)] for i in range(25))
            lines.append(f"def func{m}_{f}(x, y=1):\n    \"\"\"Return {doc}.\"\"\"\n    return x\n")
        lines.append("def _private():\n    \"\"\"" + "hidden " * 20 + "\"\"\"\n")
        (root / f"mod{m:02d}.py").write_text("\n".join(lines))
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text('"""' + "never " * 40 + '"""\n')
    return root


def chat_len(tok, text: str) -> int:
    return len(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.mark.parametrize("style", ["summarization", "rag"])
@pytest.mark.parametrize("length", [300, 1000])
def test_a_prompt_has_the_length_asked_for(tok, root, style, length):
    p = long_prompt(tok, style, length, root)
    assert abs(chat_len(tok, p.turns[0]) - length) <= max(2, length // 200)
    assert p == long_prompt(tok, style, length, root)  # the same prompt every time
    assert "never" not in p.turns[0] and "hidden" not in p.turns[0]  # no tests, no private names
    assert p.category == f"long-{style}" and p.question_id == f"{style}-{length}"


def test_the_rag_question_asks_about_a_passage_the_prompt_holds(tok, root):
    text = long_prompt(tok, "rag", 1000, root).turns[0]
    question = text.rsplit("\n\n", 1)[1]
    name = question.split("`")[1]
    n = question.split("passage [")[1].split("]")[0]
    assert f"[{n}] {name}\n" in text


def test_prompts_round_trip_through_a_prompt_file(tok, root, tmp_path):
    ps = long_prompts(tok, [300, 600], root=root)
    assert [p.question_id for p in ps] == ["summarization-300", "rag-300", "summarization-600", "rag-600"]
    write_jsonl(ps, tmp_path / "long.jsonl")
    back = read_prompt_file(tmp_path / "long.jsonl")
    assert [(b.question_id, b.turns) for b in back] == [(p.question_id, p.turns) for p in ps]


def test_bad_requests_are_clear_errors(tok, root, tmp_path):
    with pytest.raises(SpecdecError, match="unknown long-prompt style 'poem'"):
        long_prompt(tok, "poem", 1000, root)
    with pytest.raises(SpecdecError, match="at least 256 tokens"):
        long_prompt(tok, "rag", 100, root)
    with pytest.raises(SpecdecError, match="no docstrings found"):
        long_prompt(tok, "rag", 1000, tmp_path)
