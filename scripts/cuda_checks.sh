#!/bin/bash
# The CUDA path's exactness and verify-cost figures, as one call of the lent GPU machine (the device
# tool; see BENCHMARKS.md "On a GPU"): the losslessness suite, the distribution tests, token trees and the
# CPU/GPU agreement test with every LLM on the GPU (tests/conftest.py: SPECDEC_TEST_DEVICE), then one
# forward of random-weight models of real shapes at T = 1..32 rows against the GPU's read bandwidth.
# Needs: gguf and llguidance wheels in .whl/ (the GPU image lacks them), $OUT for the results. Here, once:
#   echo /.whl/ >> .git/info/exclude; P="--platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64"
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
#       -d .whl gguf==0.19.0 llguidance==1.9.1
# then the device tool's run with carry [".whl"]: `bash scripts/cuda_checks.sh` (timeout_s 600: the tests first, at most
# TEST_LIMIT s (400), then the step tables, STEP_LIMIT s (90) each; SHAPES="" skips them, PROFILE="" the profile).
set -u
OUT=${OUT:-/tmp/cuda_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
T0=$(date +%s)
# -o verbosity_test_cases=1: one line per test as it ends (pyproject shows dots), so a run cut by the
# time limit still says which tests passed and which failed; the conftest's log says when each started
SPECDEC_TEST_DEVICE=cuda SPECDEC_TEST_LOG="$OUT/tests.log" timeout "${TEST_LIMIT:-400}" python3 -m pytest \
    -p no:cacheprovider -v -o verbosity_test_cases=1 -n 8 --dist load \
    --tb=short -rfE --junitxml="$OUT/junit.xml" \
    tests/test_llm.py tests/proposers/test_lossless_suite.py tests/proposers/test_distribution.py \
    tests/engine/test_tree.py tests/quant/test_linear.py tests/models/test_cuda_graphs.py \
    tests/tools/bench/test_step.py >"$OUT/pytest.log" 2>&1
echo "pytest rc $? in $(( $(date +%s) - T0 )) s"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "(FAILED|ERROR) tests/" "$OUT/pytest.log" | head -30
for s in ${SHAPES-qwen2.5-1.5b qwen2.5-0.5b llama-3-8b qwen2.5-7b}; do  # the eager path and CUDA graphs, interleaved
    timeout "${STEP_LIMIT:-90}" python3 -m specdec.tools.bench.step --shape "$s" --device cuda --rows 1,2,4,8,16,32 --repeats 20 \
        --output "$OUT/step-$s.json" 2>&1 | grep -v "^|---" | tail -9
done
[ -n "${PROFILE-1}" ] && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." timeout 90 python3 -m specdec.tools.bench.cuda_profile qwen2.5-1.5b 2>&1 | tail -45
