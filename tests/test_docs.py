"""The docs site: the generated methods page matches the registry, the Benchmarks section lists every
page under docs/bench/, and the README stays a front page."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.docs import FAMILIES_PAGE, METHODS_PAGE, families_page, methods_page, write_methods_page
from specdec.proposers.registry import schemas

ROOT = Path(__file__).resolve().parents[1]


def load_hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_methods_page_is_the_generated_one():
    committed = (ROOT / METHODS_PAGE).read_text(encoding="utf-8")
    assert committed == methods_page(), "docs/methods.md is stale: run `python scripts/gen_docs.py`"


def test_the_committed_families_page_is_the_generated_one():
    committed = (ROOT / FAMILIES_PAGE).read_text(encoding="utf-8")
    assert committed == families_page(), "docs/families.md is stale: run `python scripts/gen_docs.py`"


def test_the_families_page_names_every_family_and_says_which_run_natively(monkeypatch):
    from specdec.families import FAMILIES  # noqa: PLC0415
    from specdec.models import native  # noqa: PLC0415
    page = families_page()
    for fam in FAMILIES.values():
        assert f"| `{fam.model_type}` | `{fam.gguf_arch}` |" in page
    assert "| yes |" in page
    monkeypatch.setattr(native, "missing_features", lambda cfg: ["a switch it lacks"])  # what a family lacking one says
    assert "| PyTorch path: a switch it lacks |" in families_page()


def test_the_methods_page_names_every_method_and_option_of_the_registry():
    page = methods_page()
    for cls in schemas():
        assert f"- `{cls.method}`: {cls.summary}" in page
        for f in dataclasses.fields(cls):
            if not f.name.startswith("_"):
                assert f"| `{cls.method}` | `{f.name}` |" in page, (cls.method, f.name)


def test_writing_the_page_only_when_it_changed(tmp_path):
    (tmp_path / "docs").mkdir()
    assert write_methods_page(tmp_path) is True
    assert (tmp_path / METHODS_PAGE).read_text(encoding="utf-8") == methods_page()
    assert write_methods_page(tmp_path) is False  # unchanged: left alone


def test_the_benchmarks_section_lists_every_page_under_docs_bench(tmp_path):
    hooks = load_hooks()
    bench = tmp_path / "bench"
    (bench / "sub").mkdir(parents=True)
    for name in ("index.md", "history.md", "zeta.md", "gumbel.md", "sub/report.md"):
        (bench / name).write_text("# x\n")
    (bench / "plot.png").write_bytes(b"")
    nav = [{"Home": "index.md"}, {"Benchmarks": "bench/"}, {"Internals": [{"A": "a.md"}]}]
    out = hooks.expand(nav, tmp_path)
    assert out[0] == {"Home": "index.md"} and out[2] == {"Internals": [{"A": "a.md"}]}
    assert out[1] == {"Benchmarks": ["bench/index.md", "bench/history.md", "bench/gumbel.md",
                                     "bench/sub/report.md", "bench/zeta.md"]}


def test_a_root_file_pulled_into_a_page_gets_links_relative_to_the_page(tmp_path):
    """docs/bench/index.md is BENCHMARKS.md by a snippet line; that file's links are written from the
    repository's root (right on GitHub), and in the site they pointed at bench/docs/bench/...: six
    broken links on the benchmarks index that failed `mkdocs build --strict`."""
    hooks = load_hooks()
    (tmp_path / "BENCH.md").write_text("See [n](docs/bench/native.md#a-part), [q](docs/quantization.md), "
                                       "[web](https://x.org/docs/y.md).\n")
    page = '--8<-- "BENCH.md"\n'
    out = hooks.inline_root_files(page, "bench/index.md", root=tmp_path)
    assert out.rstrip() == "See [n](native.md#a-part), [q](../quantization.md), [web](https://x.org/docs/y.md)."
    assert hooks.inline_root_files('--8<-- "missing.md"\n', "bench/index.md", root=tmp_path) == '--8<-- "missing.md"\n'
    assert hooks.root_links("[m](docs/methods.md)", "index.md") == "[m](methods.md)"
    real = hooks.inline_root_files((ROOT / "docs" / "bench" / "index.md").read_text(), "bench/index.md")
    assert "](docs/" not in real


def test_the_site_builds_its_methods_page_from_the_registry_not_from_the_committed_copy():
    pytest.importorskip("mkdocs")
    from mkdocs.config import load_config
    from mkdocs.structure.files import File, Files

    hooks = load_hooks()
    config = load_config(str(ROOT / "mkdocs.yml"))
    config.plugins._current_plugin = None  # what a build sets before calling hooks
    stale = File("methods.md", config["docs_dir"], config["site_dir"], config["use_directory_urls"])
    files = hooks.on_files(Files([stale]), config=config)
    pages = [f for f in files if f.src_uri == "methods.md"]
    assert len(pages) == 1 and pages[0] is not stale and pages[0].content_string == methods_page()


def test_mkdocs_yml_builds_the_benchmarks_section_from_the_folder():
    text = (ROOT / "mkdocs.yml").read_text()
    assert "  - Benchmarks: bench/\n" in text and "scripts/mkdocs_hooks.py" in text and "name: material" in text
    assert '--8<-- "BENCHMARKS.md"' in (ROOT / "docs" / "bench" / "index.md").read_text()


def test_the_readme_is_a_front_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "bash scripts/setup.sh && .venv/bin/specdec demo" in readme
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in readme
    assert "docs/images/playground.png" in readme and "## The shape of the house" in readme


def docs_check(project: Path) -> subprocess.CompletedProcess:
    """scripts/docs_check.sh, the docs step of .ci/run, on the site whose mkdocs.yml is in ``project``."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "docs_check.sh"), str(project)], capture_output=True,
                          text=True, env=os.environ | {"PYTHON": sys.executable}, timeout=300)


def test_the_docs_step_fails_on_a_broken_link_and_passes_the_real_docs(tmp_path):
    """Issue 59, item 8: CI built the docs with ``mkdocs build --strict --quiet``, and ``--quiet`` drops
    the warnings strict mode counts, so a broken link passed (docs/bench/history.md linked
    ``docs/families.md`` from inside docs/bench/). The step is now scripts/docs_check.sh, which .ci/run
    calls: a copy of the site with a broken link planted fails it, naming the link; the real docs pass."""
    pytest.importorskip("mkdocs")
    assert "bash scripts/docs_check.sh" in (ROOT / ".ci" / "run").read_text()
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "scripts").mkdir()
    for name in ("mkdocs.yml", "BENCHMARKS.md", "scripts/mkdocs_hooks.py"):  # the snippet of docs/bench/index.md
        shutil.copy(ROOT / name, tmp_path / name)
    with open(tmp_path / "docs" / "usage.md", "a", encoding="utf-8") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    planted = docs_check(tmp_path)
    assert planted.returncode != 0 and "no-such-page.md" in planted.stdout, planted.stdout + planted.stderr
    real = docs_check(ROOT)
    assert real.returncode == 0, real.stdout + real.stderr
    assert "WARNING" not in real.stdout and "INFO" not in real.stdout  # a short log: warnings and errors only
