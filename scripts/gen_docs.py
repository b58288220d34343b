"""Write the generated documentation pages (docs/methods.md, docs/families.md) from the code, after changing a method's
options (tests/test_docs.py fails until then; the site itself is built from the code by the MkDocs
hook in scripts/mkdocs_hooks.py)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.docs import FAMILIES_PAGE, METHODS_PAGE, write_families_page, write_methods_page  # noqa: E402

if __name__ == "__main__":
    print(f"{METHODS_PAGE}: {'written' if write_methods_page(ROOT) else 'unchanged'}")
    print(f"{FAMILIES_PAGE}: {'written' if write_families_page(ROOT) else 'unchanged'}")
