"""The statistical tests' pattern, timed: N seeded samples (3 tokens) of one short prompt on the tiny
random-weight models of tests/proposers/test_distribution.py, with a draft model. Measured before and
after identical prompts in flight shared their prefill (docs/kv-cache.md): 1,000 samples 11.3 s -> 2.0 s
(AMD EPYC Zen 1, 2 cores, 2026-11-27).

    python scripts/sampling_prefill.py [N] [prof]     # prof: cProfile into /tmp/pp.prof
"""
import cProfile
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_model_dir  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402

PROMPT = "Hello world. Hello world. Hello"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    root = Path(tempfile.mkdtemp())
    target = make_model_dir(root / "target", layers=4, hidden=64, seed=0, scale=6.0)
    draft = make_model_dir(root / "draft", layers=1, hidden=32, seed=5, scale=6.0)
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    llm.generate([PROMPT] * 50, [params.replace(seed=i) for i in range(50)])  # warm up
    run = lambda: llm.generate([PROMPT] * n, [params.replace(seed=i) for i in range(n)])  # noqa: E731
    t0 = time.perf_counter()
    if "prof" in sys.argv:
        cProfile.runctx("run()", globals(), {"run": run}, "/tmp/pp.prof")
    else:
        run()
    print(f"{n} samples: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
