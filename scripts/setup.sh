#!/usr/bin/env bash
# Set up specdec in ./.venv: PyTorch (CPU build unless one is already there), the package, test tools.
# Idempotent: a second run checks and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # pin the CPU build: an unpinned torch pulls several GB of CUDA packages
  .venv/bin/pip install --quiet "torch==2.13.0" || .venv/bin/pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/pip install --quiet -e ".[test,cluster,train,docs]"  # cluster: Ray Serve (serve --replicas); train: peft (distill); docs: mkdocs (.ci/run builds the site); tested too
# the native kernels (10-20 s with gcc; without them a PyTorch fallback runs, several times slower): a build
# that fails says so loudly on stderr, with why and the compiler's messages; under SPECDEC_REQUIRE_KERNELS=1
# (.ci/run) it exits 1, which fails the setup
.venv/bin/python -m specdec.kernels
# headless Chromium for the playground's browser test (tests/server/test_playground_browser.py skips
# without it): Debian's chromium + chromium-driver where apt-get is there and we are root; quiet, and
# never a reason for setup to fail
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
    >/dev/null 2>&1 || echo "setup: could not install chromium (the browser test will be skipped)" >&2
fi
