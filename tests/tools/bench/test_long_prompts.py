"""Long prompts from docstrings and source files: the length asked for (in the model's tokens, chat template
included), the same prompt twice, the RAG and code questions about a passage or function the prompt holds,
clear errors."""
from __future__ import annotations

import re

import pytest

from conftest import make_model_dir
from specdec.errors import SpecdecError
from specdec.formats.tokenizer import Tokenizer
from specdec.tools.bench.long_prompts import CODE_SUMMARIZE, long_prompt, long_prompts, stdlib_root, write_jsonl
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
    assert [p.question_id for p in ps] == ["summarization-300", "rag-300", "code-300",
                                           "summarization-600", "rag-600", "code-600"]
    write_jsonl(ps, tmp_path / "long.jsonl")
    back = read_prompt_file(tmp_path / "long.jsonl")
    assert [(b.question_id, b.turns) for b in back] == [(p.question_id, p.turns) for p in ps]


def test_bad_requests_are_clear_errors(tok, root, tmp_path):
    with pytest.raises(SpecdecError, match="unknown long-prompt style 'poem': one of summarization, rag, code"):
        long_prompt(tok, "poem", 1000, root)
    with pytest.raises(SpecdecError, match="at least 256 tokens"):
        long_prompt(tok, "rag", 100, root)
    with pytest.raises(SpecdecError, match="at least 256 tokens, got 255"):
        long_prompt(tok, "code", 255, root)
    with pytest.raises(SpecdecError, match="no docstrings found"):
        long_prompt(tok, "rag", 1000, tmp_path)
    with pytest.raises(SpecdecError, match="no Python source files found"):
        long_prompt(tok, "code", 1000, tmp_path)


def code_question(text: str) -> tuple[str, str, str]:
    """(the code, the function's name, its file) of a code prompt asking about one function."""
    code, question = text.rsplit("\n\n", 1)
    name, file = re.fullmatch(r".*Explain step by step what `([\w.]+)` in `([^`]+)` does.*", question).groups()
    return code, name, file


@pytest.mark.parametrize("length", [256, 300, 1000, 2500])
def test_a_code_prompt_has_the_length_asked_for(tok, root, length):
    p = long_prompt(tok, "code", length, root)
    assert abs(chat_len(tok, p.turns[0]) - length) <= max(2, length // 200)
    assert p == long_prompt(tok, "code", length, root)  # the same prompt every time
    assert p.category == "long-code" and p.question_id == f"code-{length}"
    assert "never" not in p.turns[0]  # no tests
    assert p.turns[0].startswith("# ===== file: mod")


def test_a_code_prompt_too_short_to_hold_a_whole_function_asks_about_the_files(tok, root):
    text = long_prompt(tok, "code", 256, root).turns[0]  # part of one file of the fixture: its last def cut
    assert text.endswith("\n\n" + CODE_SUMMARIZE) and "step by step" not in text


@pytest.mark.parametrize("length", [1000, 2500])
def test_a_code_prompt_asks_about_a_function_it_holds_whole(tok, root, length):
    p = long_prompt(tok, "code", length, root)
    code, name, file = code_question(p.turns[0])
    # the function is defined (once) in the file the question names, whole: a later definition follows it
    files = re.split(r"^# ===== file: (.+) =====$", code, flags=re.M)[1:]
    held = dict(zip(files[::2], files[1::2]))
    assert re.findall(rf"^def {name}\(", held[file], re.M) and code.count(f"def {name}(") == 1
    assert code.index(f"def {name}(") < code.rindex("def ")
    assert len(held) >= 2  # whole source files, one after another


def test_code_prompts_of_other_lengths_start_elsewhere(tok, root):
    starts = {long_prompt(tok, "code", n, root).turns[0].split("\n", 1)[0] for n in (300, 400, 500, 600, 700)}
    assert len(starts) > 1


def test_a_code_prompt_from_the_real_standard_library(tok):
    length = 1500
    p = long_prompt(tok, "code", length, stdlib_root())
    assert abs(chat_len(tok, p.turns[0]) - length) <= max(2, length // 200)
    code, name, file = code_question(p.turns[0])
    cls, _, func = name.rpartition(".")
    source = code.split(f"# ===== file: {file} =====\n", 1)[1]
    if cls:  # a method: in its class, before the next class
        body = source.split(f"\nclass {cls}", 1)[1]
        assert re.search(rf"^    (async )?def {func}\(", re.split(r"^class ", body, flags=re.M)[0], re.M)
    else:
        assert re.search(rf"^(async )?def {func}\(", source, re.M)
    assert (stdlib_root() / file).is_file()


def test_a_code_prompt_names_a_method_by_its_class(tok, tmp_path):
    """Two classes with an ``encode`` each: the question names one of them as Class.encode."""
    (tmp_path / "codec.py").write_text("".join(
        f"class Codec{i}:\n    def encode(self, text):\n        return text * {i}\n\n" for i in range(60)))
    code, name, file = code_question(long_prompt(tok, "code", 1000, tmp_path).turns[0])
    assert file == "codec.py" and re.fullmatch(r"Codec\d+\.encode", name)
    assert f"class {name.split('.')[0]}:\n    def encode(" in code
