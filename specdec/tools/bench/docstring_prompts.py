"""A one-domain prompt set for `specdec distill` and `specdec bench`: "write a docstring for this
Python function" over functions of the CPython standard library (their own docstrings removed).

    python -m specdec.tools.bench.docstring_prompts --output docstrings.jsonl [--count 400]

Records are Spec-Bench style (`{"question_id", "category": "docstring", "turns": [...]}`), in a
stable order (sorted files, first functions of each file), so the same command gives the same file.
"""
from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

ASK = "Write a concise docstring (one summary line, then the arguments and the return value) for this Python function:\n\n```python\n{code}\n```"


def functions(path: Path, max_lines: int):
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            body = node.body[1:]
            if not body or node.name.startswith("_"):
                continue
            node.body = body  # without its docstring
            code = ast.unparse(node)
            if 4 <= code.count("\n") + 1 <= max_lines:
                yield node.name, code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--per-file", type=int, default=3)
    p.add_argument("--max-lines", type=int, default=40)
    a = p.parse_args(argv)
    root = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    with open(a.output, "w", encoding="utf-8") as f:
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or "idlelib" in path.parts:
                continue
            for i, (name, code) in enumerate(functions(path, a.max_lines)):
                if i >= a.per_file or n >= a.count:
                    break
                rid = f"{path.relative_to(root)}:{name}"
                f.write(json.dumps({"question_id": rid, "category": "docstring", "turns": [ASK.format(code=code)]}) + "\n")
                n += 1
            if n >= a.count:
                break
    print(f"{n} prompts -> {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
