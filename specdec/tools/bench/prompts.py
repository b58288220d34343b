"""Benchmark prompts: JSONL files in Spec-Bench's format (chat turns) or raw completion prompts.

One record per line, either

    {"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]}
    {"category": "code", "prompt": "def fibonacci(n):"}           # raw completion, no chat template

``turns`` records are chat-templated (the first turn, or every turn with ``all_turns``: each turn
then follows the model's own answer to the one before). ``category`` is optional ("default").
Spec-Bench labels its MT-bench questions with MT-bench's subcategories; they fold into "mt-bench".
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdec.errors import SpecdecError

MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
SPEC_BENCH_ORDER = ("mt-bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark question: chat ``turns`` (user messages) or a raw completion ``prompt``."""

    index: int  # position in the selected list
    question_id: str
    category: str
    turns: tuple[str, ...] = ()
    prompt: str | None = None
    subcategory: str | None = None  # the file's own label when it was folded (MT-bench)

    @property
    def is_chat(self) -> bool:
        return self.prompt is None


def spec_bench_category(cat: str) -> str:
    """Spec-Bench files label MT-bench questions by their MT-bench subcategory: fold them."""
    return "mt-bench" if cat in MT_BENCH else cat


def default_prompts_path() -> Path:
    """The small prompt set shipped with the package (code, chat, summarization, JSON extraction)."""
    return Path(str(resources.files("specdec.tools.bench") / "data" / "default_prompts.jsonl"))


def _record(rec: object, where: str, line_no: int) -> BenchPrompt:
    """Validate one parsed JSON line; ``where`` names the file in error messages."""
    if not isinstance(rec, dict):
        raise SpecdecError(f"{where} line {line_no}: a record must be a JSON object, got {type(rec).__name__}")
    cat = rec.get("category", "default")
    if not isinstance(cat, str) or not cat.strip():
        raise SpecdecError(f"{where} line {line_no}: 'category' must be a non-empty string, got {cat!r}")
    qid = rec.get("question_id", line_no)
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise SpecdecError(f"{where} line {line_no}: 'question_id' must be a string or an integer, got {qid!r}")
    if "turns" in rec:
        turns = rec["turns"]
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise SpecdecError(f"{where} line {line_no}: 'turns' must be a non-empty list of non-empty "
                               "strings (the user's messages)")
        folded = spec_bench_category(cat)
        return BenchPrompt(index=0, question_id=str(qid), category=folded, turns=tuple(turns),
                           subcategory=cat if folded != cat else None)
    if "prompt" in rec:
        prompt = rec["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise SpecdecError(f"{where} line {line_no}: 'prompt' must be a non-empty string, got "
                               f"{type(prompt).__name__}")
        return BenchPrompt(index=0, question_id=str(qid), category=cat, prompt=prompt)
    raise SpecdecError(f"{where} line {line_no}: a record needs 'turns' (a list of user messages, "
                       "Spec-Bench format) or 'prompt' (a raw completion prompt)")


def read_prompt_file(path: str | Path) -> list[BenchPrompt]:
    """Every record of a JSONL prompt file, validated (errors name the line). Blank lines are skipped."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise SpecdecError(f"prompt file '{p}' does not exist: give a JSONL file (see `specdec bench --help`)") \
            from e
    except OSError as e:
        raise SpecdecError(f"cannot read prompt file '{p}': {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise SpecdecError(f"prompt file '{p}' is not UTF-8 text") from e
    items = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{p} line {n}: not valid JSON ({e.msg} at column {e.colno}): "
                               "each line must be one JSON object") from e
        items.append(_record(rec, str(p), n))
    if not items:
        raise SpecdecError(f"prompt file '{p}' holds no records: one JSON object per line")
    return items


def select(items: list[BenchPrompt], categories: list[str] | None = None,
           limit: int | None = None) -> list[BenchPrompt]:
    """Keep the given categories (folded names) and at most ``limit`` prompts per category.

    Categories come in the order they first appear, each in file order, except that a folded
    category takes its subcategories in turn (a limit of 3 on MT-bench gives writing, roleplay,
    reasoning, not three writing questions).
    """
    if limit is not None and limit < 1:
        raise SpecdecError(f"--limit must be at least 1 (prompts per category), got {limit}")
    available = list(dict.fromkeys(it.category for it in items))
    if categories:
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise SpecdecError(f"unknown category {unknown[0]!r}: the prompts have {', '.join(available)}")
    by_cat: dict[str, dict[str | None, list[BenchPrompt]]] = defaultdict(lambda: defaultdict(list))
    for it in items:
        if not categories or it.category in categories:
            by_cat[it.category][it.subcategory].append(it)
    out: list[BenchPrompt] = []
    for subs in by_cat.values():
        queues = list(subs.values())
        taken = [q.pop(0) for _ in range(max(map(len, queues))) for q in queues if q]
        for it in taken[:limit]:
            out.append(BenchPrompt(len(out), it.question_id, it.category, it.turns, it.prompt, it.subcategory))
    return out


def load_prompts(path: str | Path | list[str | Path] | None = None, categories: list[str] | None = None,
                 limit: int | None = None) -> list[BenchPrompt]:
    """The prompts to run: ``path`` (one file or several, concatenated; default: the packaged set),
    filtered and limited per category. ``packaged`` in the list stands for the packaged set."""
    paths = [path] if path is None or isinstance(path, (str, Path)) else list(path)
    items = []
    for p in paths:
        items += read_prompt_file(default_prompts_path() if p is None or str(p) == "packaged" else p)
    return select(items, categories, limit)


def parse_categories(arg: str | None) -> list[str] | None:
    """'a,b' -> ['a', 'b'] (None or empty: every category)."""
    if not arg:
        return None
    cats = [c.strip() for c in arg.split(",") if c.strip()]
    if not cats:
        raise SpecdecError("--categories is empty: give names separated by commas, e.g. code,chat")
    return cats


def category_order(cats: list[str]) -> list[str]:
    """Spec-Bench's column order first, then the others as they came."""
    known = [c for c in SPEC_BENCH_ORDER if c in cats]
    return known + [c for c in dict.fromkeys(cats) if c not in known]
