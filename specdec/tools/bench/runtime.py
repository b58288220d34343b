"""Runtime benchmark: machine bandwidth, plain decode speed, multi-token forward cost, load times.

    python -m specdec.tools.bench.runtime --model qwen2.5-coder-1.5b --output results/runtime.json

Prints markdown tables for BENCHMARKS.md. Not a test: numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.config import SamplingParams
from specdec.quant.linear import Linear

CODE_PROMPT = "Write a Python class implementing an LRU cache with get and put methods, with type hints."


def write_report(path, report: dict) -> None:
    """A tool's figures as JSON at ``path`` (its folder made), for the tables built from them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def read_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Best read bandwidth in GB/s as MODELS.md measures it: a torch sum over ``gib`` GiB, all threads."""
    a = torch.ones(int(gib * 2**30) // 4)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def _run_probe(name: str, *args: str) -> list[float] | None:
    """Compile ``csrc/<name>.c`` for this CPU and run it: the numbers it prints, or None, said on stderr,
    where it cannot (no gcc; dot_peak.c on a CPU other than x86: the probes build for AVX-512 or AVX2,
    and read_bw.c elsewhere, aarch64 included, for the compiler's own vectors)."""
    src = Path(__file__).parent / "csrc" / f"{name}.c"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / name
        try:
            subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)],
                           check=True, capture_output=True, text=True)
            r = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"bench: the {name} probe (csrc/{name}.c) does not run on this {platform.machine()} machine "
                  f"({_why(e)}): its numbers are left out", file=sys.stderr)
            return None
    return [float(v) for v in r.stdout.split()]


def _why(e: Exception) -> str:
    """A failed probe's reason: the compiler's error line (an ``#error`` says what the probe needs), else
    the exception."""
    lines = (getattr(e, "stderr", None) or "").strip().splitlines()
    return next((ln.strip() for ln in lines if "error" in ln), lines[0].strip() if lines else str(e))[:300]


def read_bandwidth_avx512(gib: float = 2.0, repeats: int = 5) -> float | None:
    """Best read bandwidth in GB/s from csrc/read_bw.c: AVX-512 (else AVX2; on aarch64 NEON) loads on all
    threads, nothing else.

    A tighter roofline than the torch sum (whose adds cost time too). None without gcc.
    """
    out = _run_probe("read_bw", str(gib), str(repeats))
    return out[0] if out else None


def dot_peak() -> dict[str, float] | None:
    """Peak multiply-adds per second on all threads (csrc/dot_peak.c): ``int8`` through vpdpbusd (the
    int8/int4 products, 64 each), ``bf16`` through vdpbf16ps (the bf16 products, 32 each); on AVX2 CPUs
    the AVX2 kernels' sequences instead (vpmaddubsw + vpaddw, a vpmaddwd per 8; widened pairs and two FMAs). None
    without gcc, and on other architectures (no probe for aarch64 yet: the compute floors are left out)."""
    out = _run_probe("dot_peak")
    return {"int8": out[0] * 64, "bf16": out[1] * 32} if out else None


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every Linear (LM head included) and the norms."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, Linear):
            size = (mod.bias if mod.bias is not None else mod.weight).element_size()
            total += (mod.in_features + (mod.bias is not None)) * mod.out_features * size
        elif type(mod).__name__ == "RMSNorm":
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def decode_speed(llm, max_tokens: int, repeats: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(CODE_PROMPT, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    rates = [llm.chat([{"role": "user", "content": CODE_PROMPT}], params)[0].metrics.decode_tokens_per_second
             for _ in range(repeats)]
    return {"decode_tok_s_median": statistics.median(rates), "decode_tok_s_all": rates}


@torch.inference_mode()
def forward_cost(model, context: int = 128, sizes=(1, 2, 4, 8, 16), repeats: int = 5) -> dict[int, float]:
    """Seconds of one forward over T new tokens after ``context`` cached ones (best of repeats)."""
    cache = model.new_cache(1, context + max(sizes) + 1)
    toks = torch.randint(0, model.config.vocab_size, (1, context + max(sizes)))
    model(toks[:, :context], torch.arange(context)[None], cache, logits_positions="none")
    out = {}
    for t in sizes:
        pos = torch.arange(context, context + t)[None]
        model(toks[:, context:context + t], pos, cache)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(toks[:, context:context + t], pos, cache)
            best = min(best, time.perf_counter() - t0)
        out[t] = best
    return out


LOAD_SNIPPET = """
import json, sys, time
t = time.perf_counter()
from specdec.llm import LLM
llm = LLM(model=sys.argv[1], progress=False)
dt = time.perf_counter() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": dt, "peak_rss_gb": hwm / 2**20}))
"""


def load_times(name: str) -> dict:
    """First load (assemble + checksum + convert; wheels already downloaded) and cached load."""
    from specdec.home import specdec_home  # noqa: PLC0415
    home = specdec_home()
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        wheels = home / "wheels" / name
        if wheels.is_dir():
            shutil.copytree(wheels, Path(tmp) / "wheels" / name)
        env = dict(os.environ, SPECDEC_HOME=tmp)
        runs = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", LOAD_SNIPPET, name], env=env, capture_output=True,
                               text=True, check=True)
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {"first": runs[0], "cached": runs[1]}


def ngram_lookup_seconds(context: int = 16_000, repeats: int = 10) -> float:
    """Seconds per n-gram lookup on a ``context``-token history with no match (its worst case)."""
    import numpy as np  # noqa: PLC0415

    from specdec.proposers.ngram import ngram_lookup  # noqa: PLC0415
    toks = np.random.default_rng(0).integers(0, 150_000, size=context)
    t = time.perf_counter()
    for _ in range(repeats):
        ngram_lookup(toks, 1, 4, 5)
    return (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--load-models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--output", default="results/runtime.json")
    a = ap.parse_args()
    from specdec.llm import LLM  # noqa: PLC0415

    res: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    res["read_bandwidth_gb_s"] = bw = read_bandwidth()
    res["read_bandwidth_avx512_gb_s"] = bw2 = read_bandwidth_avx512()
    print(f"machine read bandwidth: torch sum {bw:.1f} GB/s, AVX-512 loads {bw2} GB/s "
          f"({res['threads']} threads)", flush=True)
    res["ngram_lookup_16k_seconds"] = ng = ngram_lookup_seconds()
    print(f"n-gram lookup over 16k tokens, no match: {ng * 1e3:.2f} ms per call", flush=True)
    res["forward_cost"] = {}
    for dt in a.dtypes.split(","):
        llm = LLM(model=a.model, dtype=dt, progress=False)
        if dt == "bfloat16":
            sp = decode_speed(llm, a.max_tokens, a.repeats)
            nbytes = weight_bytes_per_token(llm.target.model)
            sp |= {"weight_bytes_per_token": nbytes,
                   "achieved_gb_s": nbytes * sp["decode_tok_s_median"] / 1e9}
            sp["fraction_of_bandwidth"] = sp["achieved_gb_s"] / bw
            sp["fraction_of_avx512_bandwidth"] = sp["achieved_gb_s"] / bw2 if bw2 else None
            res["decode"] = sp
            print(f"plain greedy decode {a.model} bf16 batch 1: {sp['decode_tok_s_median']:.2f} tok/s, "
                  f"{nbytes / 1e9:.2f} GB/token -> {sp['achieved_gb_s']:.1f} GB/s "
                  f"= {100 * sp['fraction_of_bandwidth']:.0f}% of {bw:.1f} GB/s (torch sum)"
                  + (f", {100 * sp['fraction_of_avx512_bandwidth']:.0f}% of {bw2:.1f} GB/s (AVX-512)"
                     if bw2 else ""), flush=True)
        cost = forward_cost(llm.target.model)
        res["forward_cost"][dt] = {t: {"seconds": s, "relative": s / cost[1]} for t, s in cost.items()}
        print(f"forward cost {dt}: " + ", ".join(f"T={t}: {s * 1e3:.0f} ms ({s / cost[1]:.2f}x)"
                                                  for t, s in cost.items()), flush=True)
        del llm
    res["load"] = {}
    for name in filter(None, a.load_models.split(",")):
        res["load"][name] = lt = load_times(name)
        print(f"load {name}: first {lt['first']['seconds']:.1f}s (peak {lt['first']['peak_rss_gb']:.2f} GB), "
              f"cached {lt['cached']['seconds']:.1f}s (peak {lt['cached']['peak_rss_gb']:.2f} GB)", flush=True)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}; peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")


if __name__ == "__main__":
    main()
