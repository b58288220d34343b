"""Long prompts from text every machine has: the docstrings and source files of the Python standard library.

Three styles, each at any length in tokens (of the tokenizer given, chat template included):

- ``summarization``: one stretch of documentation (the docstrings of consecutive modules, in the
  order of their files), then "summarize the documentation above";
- ``rag``: numbered passages (docstrings of functions and classes from all over the library, in a
  seeded shuffle) as a retriever would paste them, then a question about one passage in the middle
  that the answer should quote from ("which arguments does X take, what does it return");
- ``code``: source files pasted whole, one after another (consecutive files of the library, each under a
  ``# ===== file: PATH =====`` line), then a request about one function or method (``Class.method``)
  defined 40% of the way in: explain it step by step and write its docstring.

The same (style, length, tokenizer) gives the same prompt on every machine with the same Python
version. ``long_prompts`` returns ``BenchPrompt`` records (``specdec bench --prompts`` reads the JSONL
``write_jsonl`` makes); ``python -m specdec.tools.bench.long_context`` and ``specdec bench --long`` measure
acceptance, decode speedup and time to first token against prompt length.
"""
from __future__ import annotations

import ast
import functools
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.tools.bench.prompts import BenchPrompt

STYLES = ("summarization", "rag", "code")
SUMMARIZE = "Summarize the documentation above in one paragraph: what the modules are for and their main functions."
ASK = ("Using only the passages above, answer: what does `{name}` (passage [{n}]) do, which arguments does it "
       "take and what does it return? Quote the passage where you can.")
CODE_ASK = ("The files above are Python source code. Explain step by step what `{name}` in `{file}` does, then "
            "write a docstring for it in the style of that file.")
CODE_SUMMARIZE = ("The files above are Python source code. Explain what each of them does and how their parts "
                  "fit together.")
CODE_HEADER = "# ===== file: {path} ====="
MIN_DOC_CHARS = 80  # shorter docstrings ("Return self.") make poor passages


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py"))
            if not {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(p.relative_to(root).parts)]


@functools.lru_cache(maxsize=4)
def _all_docstrings(root: Path) -> tuple[tuple[str, str, str], ...]:
    return tuple(docstrings(root))


def docstrings(root: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(module, qualified name or "" for the module, docstring) in file order, then source order."""
    root = root or stdlib_root()
    for path in _files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        doc = ast.get_docstring(tree)
        if doc and len(doc) >= MIN_DOC_CHARS:
            yield module, "", doc
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOC_CHARS:
                    yield module, node.name, doc


def _fit(tokenizer, body: list[str], question: str, length: int) -> str:
    """``body`` joined and cut (in tokens) so that the chat-templated prompt is ``length`` tokens."""
    def total(text: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    overhead = total("\n\n" + question)
    text = "\n\n".join(body)
    ids = tokenizer.encode(text, add_special_tokens=False)
    keep = max(1, length - overhead)
    for _ in range(4):  # re-tokenizing the cut text shifts the count by a token or two
        cut = tokenizer.decode(ids[:keep])
        prompt = f"{cut}\n\n{question}"
        n = total(prompt)
        if abs(n - length) <= max(2, length // 200):
            break
        keep += length - n
    return prompt


def long_prompt(tokenizer, style: str, length: int, root: Path | None = None) -> BenchPrompt:
    """One prompt of ``style`` with about ``length`` tokens (within 0.5%)."""
    if style not in STYLES:
        raise SpecdecError(f"unknown long-prompt style {style!r}: one of {', '.join(STYLES)}")
    if length < 256:
        raise SpecdecError(f"a long prompt needs at least 256 tokens, got {length}")
    if style == "code":
        return BenchPrompt(index=0, question_id=f"code-{length}", category="long-code",
                           turns=(_code_prompt(tokenizer, length, root or stdlib_root()),))
    docs = list(_all_docstrings(root or stdlib_root()))
    if not docs:
        raise SpecdecError(f"no docstrings found under {root or stdlib_root()}")
    budget_chars = 6 * length  # ~3-4 characters per token: enough text, then cut in tokens
    if style == "summarization":
        start = random.Random(length).randrange(len(docs))  # each length its own stretch of the library
        body, used = [], 0
        for module, name, doc in docs[start:] + docs[:start]:
            body.append(f"{module}.{name}: {doc}" if name else f"Module {module}:\n{doc}")
            used += len(body[-1])
            if used > budget_chars:
                break
        text = _fit(tokenizer, body, SUMMARIZE, length)
    else:
        named = [d for d in docs if d[1]]
        random.Random(length).shuffle(named)
        body, used, picks = [], 0, []
        for module, name, doc in named:
            body.append(f"[{len(body) + 1}] {module}.{name}\n{doc}")
            picks.append(f"{module}.{name}")
            used += len(body[-1])
            if used > budget_chars:
                break
        n = max(1, int(0.4 * _passages_within(tokenizer, body, length)))  # 40% of the way into what is kept
        text = _fit(tokenizer, body, ASK.format(name=picks[n - 1], n=n), length)
    return BenchPrompt(index=0, question_id=f"{style}-{length}", category=f"long-{style}", turns=(text,))


# a file's header line, a class, or a public function / method (at most one indent: a class's)
_CODE_NAMES = re.compile(r"^# ===== file: (.+) =====$|^class (\w+)|^(    )?(?:async )?def ([A-Za-z]\w*)\(", re.M)


def _code_prompt(tokenizer, length: int, root: Path) -> str:
    """Consecutive source files (from a start each length picks), cut to ``length`` tokens, then a request
    about a public function or method defined 40% of the way into those the cut text holds whole (else,
    none held whole, a request to explain the files)."""
    files = _files(root)
    if not files:
        raise SpecdecError(f"no Python source files found under {root}")
    start = random.Random(length).randrange(len(files))
    body, used = [], 0
    for path in files[start:] + files[:start]:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        body.append(CODE_HEADER.format(path=path.relative_to(root).as_posix()) + "\n" + source.rstrip())
        used += len(body[-1])
        if used > 6 * length:  # ~3-4 characters per token: enough text, then cut in tokens
            break
    probe = CODE_ASK.format(name="ClassName.function", file="package/module.py")  # about as long as the real one
    cut = _fit(tokenizer, body, probe, length).removesuffix(probe)
    # (file, function or Class.method) for each definition in the cut text, the last one left out (its
    # body may be cut), then those named once
    defs, file, cls = [], None, None
    for m in _CODE_NAMES.finditer(cut):
        if m.group(1):
            file, cls = m.group(1), None
        elif m.group(2):
            cls = m.group(2)
        elif file is not None and (cls or not m.group(3)):
            cls = cls if m.group(3) else None
            defs.append((file, f"{cls}.{m.group(4)}" if cls else m.group(4)))
    defs = [d for d in defs[:-1] if defs.count(d) == 1]
    if not defs:
        return _fit(tokenizer, body, CODE_SUMMARIZE, length)
    file, name = defs[int(0.4 * len(defs))]
    return _fit(tokenizer, body, CODE_ASK.format(name=name, file=file), length)


def _passages_within(tokenizer, body: list[str], length: int) -> int:
    """How many of ``body``'s passages fit whole in ``length`` tokens."""
    n, used = 0, 0
    for passage in body:
        used += len(tokenizer.encode(passage, add_special_tokens=False)) + 1
        if used > length:
            break
        n += 1
    return max(1, n)


def long_prompts(tokenizer, lengths: list[int], styles: tuple[str, ...] = STYLES,
                 root: Path | None = None) -> list[BenchPrompt]:
    out = [long_prompt(tokenizer, s, n, root) for n in lengths for s in styles]
    return [BenchPrompt(index=i, question_id=p.question_id, category=p.category, turns=p.turns)
            for i, p in enumerate(out)]


def write_jsonl(prompts: list[BenchPrompt], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"question_id": p.question_id, "category": p.category, "turns": list(p.turns)}) + "\n")
