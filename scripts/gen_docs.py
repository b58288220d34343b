"""Write the generated documentation pages (docs/methods.md) from the code; run before `mkdocs build`
(the MkDocs hook in scripts/mkdocs_hooks.py does it too)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.docs import METHODS_PAGE, write_methods_page  # noqa: E402

if __name__ == "__main__":
    print(f"{METHODS_PAGE}: {'written' if write_methods_page(ROOT) else 'unchanged'}")
