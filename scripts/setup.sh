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
# (.ci/run) it exits 1, which fails the setup. Their rungs are x86-64's: on aarch64 (none yet) it says so
# loudly and the PyTorch path runs, required or not
.venv/bin/python -m specdec.kernels
# headless Chromium for the playground's browser test (tests/server/test_playground_browser.py skips
# without it): Debian's chromium + chromium-driver where apt-get is there and we are root; quiet, and
# never a reason for setup to fail
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
    >/dev/null 2>&1 || echo "setup: could not install chromium (the browser test will be skipped)" >&2
fi
# the other architecture's compiler for `python -m specdec.kernels --check-all` and the bit tests of the NEON
# quantized products (tests/kernels/test_neon.py, required by .ci/run): on x86-64 Debian's
# gcc-aarch64-linux-gnu and qemu-user (the harness runs under qemu-aarch64), on aarch64 gcc-x86-64-linux-gnu
# (the x86 rungs compiled only) and qemu-user (for a CPU without dotprod); where apt-get is there and we
# are root, quiet, and never a reason for setup to fail
case "$(uname -m)" in
  x86_64) cross=aarch64-linux-gnu-gcc; cross_pkgs="gcc-aarch64-linux-gnu qemu-user" ;;
  aarch64) cross=x86_64-linux-gnu-gcc; cross_pkgs="gcc-x86-64-linux-gnu qemu-user" ;;
  *) cross="" ;;
esac
if [ -n "$cross" ] && ! { command -v "$cross" && command -v qemu-aarch64; } >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # shellcheck disable=SC2086  # the package list splits on purpose
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $cross_pkgs; } >/dev/null 2>&1 \
    || echo "setup: could not install $cross_pkgs (the NEON bit tests will be skipped, or fail in CI)" >&2
fi
