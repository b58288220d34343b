"""MkDocs hooks (mkdocs.yml `hooks:`): the generated pages, and a Benchmarks section that lists every
page under docs/bench/ without naming them here.

* ``on_files``: the site's methods.md and families.md are generated from the options schemas at build time (the copy
  committed in docs/ is for readers of the repository; tests/test_docs.py fails when it is stale,
  and `python scripts/gen_docs.py` refreshes it): the build never edits the working tree;
* the nav entry ``Benchmarks`` may be given as the directory ``bench/``: it becomes the section of
  ``bench/index.md``, ``bench/history.md`` and then every other ``*.md`` under ``docs/bench/`` (any
  depth, sorted by path), so reports added there build and show without editing mkdocs.yml;
* ``on_page_markdown``: a page that is one repository-root file pulled in by a snippet line
  (``docs/bench/index.md`` is ``--8<-- "BENCHMARKS.md"``) gets the file inlined with its links written
  from the repository's root (``docs/bench/native.md``, right on GitHub) made relative to the page
  (``native.md``): the snippets extension runs after every hook, and its text's links were broken in
  the site (six on the benchmarks index, failing ``mkdocs build --strict``).
"""
from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST = ("index.md", "history.md")
SNIPPET = re.compile(r'^--8<-- "([^"/]+\.md)"[ \t]*$', re.M)  # a repository-root markdown file, whole
ROOT_LINK = re.compile(r"\]\(docs/([^)\s]+)\)")  # a link written from the repository's root into docs/


def bench_pages(docs_dir: Path, folder: str) -> list[str]:
    """The pages of ``docs_dir/folder``: index and history first, the rest sorted by path."""
    base = docs_dir / folder
    found = sorted(p.relative_to(docs_dir).as_posix() for p in base.rglob("*.md"))
    first = [f"{folder}/{name}" for name in FIRST if f"{folder}/{name}" in found]
    return first + [p for p in found if p not in first]


def expand(nav: list, docs_dir: Path) -> list:
    """``nav`` with each entry whose value is a directory (``"bench/"``) replaced by its pages."""
    out = []
    for entry in nav:
        if isinstance(entry, dict):
            (title, value), = entry.items()
            if isinstance(value, str) and value.endswith("/"):
                value = bench_pages(docs_dir, value.rstrip("/"))
            elif isinstance(value, list):
                value = expand(value, docs_dir)
            out.append({title: value})
        else:
            out.append(entry)
    return out


def on_config(config, **kwargs):
    if config.get("nav"):
        config["nav"] = expand(config["nav"], Path(config["docs_dir"]))
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File  # noqa: PLC0415

    sys.path.insert(0, str(ROOT))
    from specdec.docs import FAMILIES_PAGE, METHODS_PAGE, families_page, methods_page  # noqa: PLC0415

    for page, make in ((METHODS_PAGE, methods_page), (FAMILIES_PAGE, families_page)):
        name = page.relative_to("docs").as_posix()
        committed = files.get_file_from_path(name)
        if committed is not None:
            files.remove(committed)
        files.append(File.generated(config, name, content=make()))
    return files


def root_links(markdown: str, page: str) -> str:
    """``markdown``'s links written from the repository's root (``](docs/bench/x.md)``) made relative to
    the docs page ``page`` (``bench/index.md`` -> ``](x.md)``)."""
    base = posixpath.dirname(page) or "."
    return ROOT_LINK.sub(lambda m: f"]({posixpath.relpath(m.group(1), base)})", markdown)


def inline_root_files(markdown: str, page: str, root: Path = ROOT) -> str:
    """``markdown`` with each snippet line naming a repository-root markdown file replaced by that
    file's text, its links made relative to ``page`` (``root_links``)."""
    def inline(m: re.Match) -> str:
        path = root / m.group(1)
        return root_links(path.read_text(), page) if path.is_file() else m.group(0)
    return SNIPPET.sub(inline, markdown)


def on_page_markdown(markdown, page, config, files, **kwargs):
    return inline_root_files(markdown, page.file.src_uri)
