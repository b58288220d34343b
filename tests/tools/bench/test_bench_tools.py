"""The measuring tools under specdec/tools/bench that were scripts/ (issue 59, item 13), and the commands the
docs give for recorded figures.

Every tool moved out of scripts/ imports and answers ``--help`` (each subcommand of ``ab`` too); the tools
that only read step reports give their tables from small made-up reports; and every command or path the
docs name (``python scripts/X``, ``bash scripts/X``, any ``scripts/X``, ``python -m specdec.X``,
``specdec.tools.bench.X``) names a file or module that exists, so a doc that still names a removed script
fails here. A removed tool is named as ``git show COMMIT:scripts/X``, and that commit must hold it.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# the tools that were scripts/*.py (one module per tool; ab: attention_ab, kernel_ab, products_ab, step_ab;
# replay: replay_drafters, folded into the replay library)
MOVED = ["ab", "cache_memory", "cuda_profile", "docstring_prompts", "draft_cost", "drafts", "families_table",
         "gumbel_acceptance", "hybrid_step", "long_context", "moe_projection", "projection", "replay",
         "vs_llamabench"]
AB_COMMANDS = ["attention", "kernel", "products", "step"]


def help_of(module: str, argv: list[str], capsys) -> str:
    mod = importlib.import_module(f"specdec.tools.bench.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("module", MOVED)
def test_every_moved_tool_imports_and_answers_help(module, capsys):
    out = help_of(module, [], capsys)
    assert out.startswith("usage:"), out
    source = (ROOT / "specdec" / "tools" / "bench" / f"{module}.py").read_text()
    assert 'if __name__ == "__main__":' in source  # runnable as python -m specdec.tools.bench.<module>
    assert f"python -m specdec.tools.bench.{module}" in source  # its docstring says how to run it


@pytest.mark.parametrize("command", AB_COMMANDS)
def test_every_ab_subcommand_answers_help(command, capsys):
    assert help_of("ab", [command], capsys).startswith(f"usage: python -m specdec.tools.bench.ab {command}")


def test_a_moved_tool_runs_with_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "specdec.tools.bench.ab", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and all(c in out.stdout for c in AB_COMMANDS), out.stderr


def test_ab_step_refuses_a_directory_that_is_not_a_tree(tmp_path, capsys):
    from specdec.tools.bench import ab

    assert ab.main(["step", str(tmp_path), str(ROOT)]) == 2
    assert "not a source tree" in capsys.readouterr().err


def report(name: str, fmt: str, ms: dict[int, float]) -> dict:
    """A made-up report of the step tool, with what the table tools read of it."""
    return {"model": f"{name} (random weights)", "format": fmt, "bytes": 1.5e9, "bandwidth_gbs": 20.0,
            "limit_ms": 75.0, "kv_bytes_by_rows": {"1": 2e6},
            "rows": {f"native/{t}": {"ms": v, "fraction": 75.0 / v} for t, v in ms.items()}}


def test_the_report_tables_read_step_reports(tmp_path, capsys):
    """families_table, projection and moe_projection read only step reports: their tables from two made-up
    ones (the reference shape, and another beside it in time)."""
    from specdec.tools.bench import families_table, moe_projection, projection

    ref = report("qwen2.5-1.5b", "int4", {1: 100.0, 2: 110.0, 4: 130.0, 5: 140.0})
    other = report("qwen3-4b", "int4", {1: 200.0, 2: 210.0, 4: 260.0, 5: 270.0})
    (tmp_path / "qwen2.5-1.5b-int4.json").write_text(json.dumps(ref))
    (tmp_path / "qwen3-4b-int4.json").write_text(json.dumps(other))
    (tmp_path / "order.txt").write_text("qwen2.5-1.5b-int4\nqwen3-4b-int4\n")
    assert families_table.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and table[3].startswith("| qwen3-4b-int4 | int4 |")
    assert "1.30 (qwen2.5-1.5b-int4)" in table[3]  # the reference's T=4 / T=1, run just before it
    assert families_table.main([str(tmp_path / "order.txt")]) == 2

    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(report("qwen2.5-0.5b", "int4", {1: 10.0})))
    assert projection.main([str(tmp_path / "qwen3-4b-int4.json"), "--draft", str(draft), "--accept", "4=3.0"]) == 0
    out = capsys.readouterr().out
    assert f"**{3.0 * 200 / (4 * 10 + 270):.2f}x**" in out  # tokens x T1 / (K x draft + verify(K + 1))

    assert moe_projection.main([str(tmp_path / "qwen3-4b-int4.json"), "--batches", "1"]) == 0
    assert "| qwen3-4b | 1 | 200.0 |" in capsys.readouterr().out


# ---- the commands the docs give ----

DOC_FILES = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCRIPT = re.compile(r"(?<![\w/.:-])scripts/([\w.-]+\.(?:py|sh))\b")
REMOVED = re.compile(r"\b([0-9a-f]{7,40}):scripts/([\w.-]+\.(?:py|sh))\b")
DASH_M = re.compile(r"python3?\s+-m\s+(specdec(?:\.[a-z_][a-z0-9_]*)*)")  # NAME: a placeholder, not a module
TOOL = re.compile(r"\bspecdec\.tools\.(bench|tune)\.([a-z_][a-z0-9_]*)(?!\w)")


def doc_mentions(pattern: re.Pattern) -> list[tuple[str, int, tuple[str, ...]]]:
    return [(str(path.relative_to(ROOT)), n, m.groups())
            for path in DOC_FILES for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in pattern.finditer(line)]


def test_the_docs_name_only_scripts_that_exist():
    """``python scripts/X``, ``bash scripts/X`` or any other ``scripts/X`` in BENCHMARKS.md, the README and
    docs/: X is in scripts/ (a tool since removed is written ``git show COMMIT:scripts/X``)."""
    found = doc_mentions(SCRIPT)
    assert any(name == "setup.sh" for _, _, (name,) in found)  # the pattern finds what the README gives
    missing = [f"{path}:{n}: scripts/{name}" for path, n, (name,) in found if not (ROOT / "scripts" / name).is_file()]
    assert not missing, "the docs name scripts that are not in scripts/:\n" + "\n".join(missing)


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_the_docs_run_only_modules_that_exist():
    """``python -m specdec...`` and every ``specdec.tools.bench.X`` / ``specdec.tools.tune.X`` the docs name:
    the module (or package) is there."""
    found = doc_mentions(DASH_M)
    assert any(m == "specdec.tools.bench.step" for _, _, (m,) in found)
    missing = [f"{path}:{n}: python -m {m}" for path, n, (m,) in found if not module_exists(m)]
    for path, n, (pkg, name) in doc_mentions(TOOL):
        where = ROOT / "specdec" / "tools" / pkg
        if not ((where / f"{name}.py").is_file() or (where / name / "__init__.py").is_file()):
            missing.append(f"{path}:{n}: specdec.tools.{pkg}.{name}")
    assert not missing, "the docs name modules that do not exist:\n" + "\n".join(missing)


def test_a_removed_tool_is_named_with_a_commit_that_has_it():
    found = doc_mentions(REMOVED)
    assert found, "no doc names a removed tool as COMMIT:scripts/X"
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone: the commits of removed tools may be missing")
    bad = [f"{path}:{n}: {commit}:scripts/{name}" for path, n, (commit, name) in found
           if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:scripts/{name}"],
                             capture_output=True).returncode != 0]
    assert not bad, "these commits do not hold the tool the docs say they do:\n" + "\n".join(bad)
