#!/usr/bin/env bash
# The docs check (.ci/run; tests/test_docs.py runs it on a copy with a broken link planted): `mkdocs build
# --strict` of the site whose mkdocs.yml is in DIR (default: this repository), into a scratch folder, so a
# broken link or a missing page fails it. Not --quiet: that drops the warnings below the level strict mode
# counts, and a broken link passed. The build's INFO lines are left out of the log; its warnings, errors
# and verdict show. Exits with mkdocs's status.
# Usage: bash scripts/docs_check.sh [DIR]    PYTHON: the interpreter with mkdocs (default: the .venv's)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root}
python=${PYTHON:-$root/.venv/bin/python}
site=$(mktemp -d)
log=$(mktemp)
(cd "$dir" && NO_MKDOCS_2_WARNING=1 "$python" -m mkdocs build --strict --site-dir "$site") >"$log" 2>&1
rc=$?
grep -v '^INFO ' "$log"
rm -rf "$site" "$log"
if [ $rc -eq 0 ]; then
  echo "docs: built with no warnings (mkdocs build --strict)"
fi
exit $rc
