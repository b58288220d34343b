"""`python -m specdec.tools.bench.step`: a forward's cost against the read limit, for real models and
for random-weight models of bigger public shapes (issue 32's projection)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from specdec.tools.bench import step

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=6, vocab_size=256, tie_word_embeddings=False, attention_bias=True)


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(step.SHAPES, "tiny", TINY)
    monkeypatch.setattr(step, "read_bandwidth_avx512", lambda *a, **k: 10.0)  # no 2 GiB scan in a unit test
    monkeypatch.setattr(step, "dot_peak", lambda: {"int8": 64e9, "bf16": 32e9})
    return "tiny"


def test_a_whole_shape_and_its_slices_read_the_same_bytes(tiny_shape, tmp_path, capsys):
    """The slices' extrapolation is linear in layers, so the bytes it projects must be the whole
    depth's bytes exactly (it would have caught an extrapolation from the wrong slice, or over the
    wrong number of layers); the whole depth is measured without extrapolating."""
    whole, sliced = tmp_path / "whole.json", tmp_path / "sliced.json"
    args = ["--shape", tiny_shape, "--rows", "1,3", "--repeats", "1", "--context", "8", "--paths", "torch"]
    assert step.main(args + ["--output", str(whole)]) == 0
    assert step.main(args + ["--slices", "2,4", "--output", str(sliced)]) == 0
    out = capsys.readouterr().out
    assert "(random weights, 6 layers)" in out and "slices of 2 and 4 extrapolated" in out
    a, b = json.loads(whole.read_text()), json.loads(sliced.read_text())
    whole_model = step.random_model(tiny_shape, 6, None, False)
    assert a["bytes"] == b["bytes"] == step.bytes_read(whole_model)
    assert a["macs_per_row"] == b["macs_per_row"] == step.macs_per_row(whole_model)
    # 6 layers of (64 -> 128 qkv, 64 -> 64 o, 64 -> 256 gate/up, 128 -> 64 down) and a 64 -> 256 head
    assert a["macs_per_row"] == {"int8": 0, "bf16": 6 * 64 * (128 + 64 + 256 + 128) + 64 * 256}
    floor = a["rows"]["torch/3"]["compute_floor_ms"]
    assert floor == pytest.approx(3 * a["macs_per_row"]["bf16"] / 32e9 * 1e3)
    assert set(a["rows"]) == set(b["rows"]) == {"torch/1", "torch/3"}
    assert all(r["ms"] > 0 for r in a["rows"].values())


TINY_MOE = dict(TINY, architecture="olmoe", qk_norm="full", attention_bias=False, num_experts=16, experts_per_tok=2,
                moe_intermediate_size=64)


def test_a_mixture_of_experts_reads_the_experts_its_block_touches(monkeypatch, tmp_path, capsys):
    """On an MoE shape the bytes a forward reads grow with T: everything but the experts, plus one
    expert's bytes per (layer, expert) the block's rows route to; one row routes to exactly k per
    layer; the multiply-adds of a row count k experts, not all of them."""
    monkeypatch.setitem(step.SHAPES, "tiny-moe", TINY_MOE)
    monkeypatch.setattr(step, "read_bandwidth_avx512", lambda *a, **k: 10.0)
    monkeypatch.setattr(step, "dot_peak", lambda: {"int8": 64e9, "bf16": 32e9})
    out = tmp_path / "moe.json"
    assert step.main(["--shape", "tiny-moe", "--rows", "1,8", "--repeats", "1", "--context", "8", "--paths", "torch",
                      "--output", str(out)]) == 0
    rep = json.loads(out.read_text())
    model = step.random_model("tiny-moe", 6, None, False)
    total, one = step.expert_bytes(model)
    assert one == 2 * 64 * 128 + 2 * 64 * 64 and total == 6 * 16 * one
    touched = {int(t): n for t, n in rep["experts_touched"].items()}
    assert touched[1] == 6 * 2 and 6 * 2 < touched[8] <= 6 * 16
    assert rep["bytes_by_rows"]["8"] - rep["bytes_by_rows"]["1"] == (touched[8] - touched[1]) * one
    assert rep["bytes"] == step.bytes_read(model) - total + 12 * one
    # per row: attention (64 -> 128 qkv, 64 -> 64 o) and 2 of 16 experts (64 -> 128, 64 -> 64) in each layer, the head
    assert rep["macs_per_row"]["bf16"] == 6 * (64 * 192 + 2 * (64 * 128 + 64 * 64)) + 64 * 256
    assert "| 8 |" in capsys.readouterr().out


def test_a_ready_context_is_filled_once_per_model_and_block(tiny_shape, monkeypatch):
    """time_forward with a shared ``ready`` dict fills the context once per (model, rows) (random keys written
    into the cache, no forward of the context) and then times only the block's forward, rewriting the same
    slots (a rejected draft's)."""
    model = step.random_model(tiny_shape, 2, None, False)
    calls, fills = [], []
    real, fill = model.forward, step.fill_context

    def counting(tokens, *a, **k):
        calls.append(tokens.shape[1])
        return real(tokens, *a, **k)

    def filling(m, cache, toks):
        fills.append(toks.shape[1])
        fill(m, cache, toks)
        keys = cache.k[:, 1:]
        assert bool(keys.abs().sum() > 0) and bool(torch.isfinite(keys.float()).all())
        assert bool((cache.k[:, 0] == 0).all())  # the null block stays zeros

    model.forward = counting
    monkeypatch.setattr(step, "fill_context", filling)
    ready: dict = {}
    for _ in range(3):
        assert step.time_forward(model, 2, 8, ready) > 0
    assert fills == [8] and calls == [2, 2, 2, 2]  # one fill of the context, one warm block, three timed blocks
    assert len(ready) == 1
    step.time_forward(model, 3, 8, ready)
    assert len(ready) == 2 and fills == [8, 8] and calls[-2:] == [3, 3]


def test_the_compute_floor_counts_each_format_at_its_own_rate():
    peak = {"int8": 64e9, "bf16": 32e9}
    assert step.compute_floor_ms({"int8": 64_000_000, "bf16": 32_000_000}, peak, 2) == pytest.approx(4.0)
    assert step.compute_floor_ms({"int8": 1, "bf16": 1}, None, 8) is None


def test_the_dot_product_probe_measures_both_instructions():
    from native_util import require_native  # noqa: PLC0415
    require_native()  # skips without the kernels; fails under SPECDEC_REQUIRE_KERNELS=1
    peak = step.dot_peak()
    assert peak is not None and peak["int8"] > 1e10 and peak["bf16"] > 5e9


@pytest.mark.parametrize("isa", [["-mavx2", "-mfma", "-mf16c"],
                                 ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"]],
                         ids=["avx2", "avx512"])
def test_the_probe_times_the_products_not_only_the_adds(isa):
    """The peak is the products' rate only if the loop runs them: the AVX2 branch once timed vpmaddubsw
    on constant operands, which the compiler hoisted out of the loop (one product for all of it), so the
    int8 'peak' was the rate of vpaddd and every int4 compute floor on AVX2 CPUs was ~2x too low."""
    import platform
    import re
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 probe: compiled where gcc targets x86")
    src = Path(step.__file__).parent / "csrc" / "dot_peak.c"
    asm = subprocess.run(["gcc", "-O3", *isa, "-fopenmp", "-S", "-o", "-", str(src)], check=True,
                         capture_output=True, text=True).stdout
    body = re.search(r"^int8_chains[^\n]*:\n(.*?)^\s+ret", asm, re.S | re.M)
    assert body, "no int8_chains in the probe's assembly"
    products = len(re.findall(r"\bvpmaddubsw\b|\bvpdpbusd\b", body.group(1)))
    assert products >= 6, f"{products} product instructions in the timed function: hoisted out of its loop"


def test_a_machine_without_the_probes_gets_its_report_without_them(tiny_shape, monkeypatch, tmp_path, capsys):
    """Where the probes do not run (no gcc; dot_peak.c on aarch64, which has no probe yet) the report
    leaves the read limit and the compute floor out; before, formatting the missing bandwidth raised."""
    monkeypatch.setattr(step, "read_bandwidth_avx512", lambda *a, **k: None)
    monkeypatch.setattr(step, "dot_peak", lambda: None)
    out = tmp_path / "r.json"
    args = ["--shape", tiny_shape, "--rows", "1,2", "--repeats", "1", "--context", "8", "--paths", "torch"]
    assert step.main(args + ["--output", str(out)]) == 0
    assert "read bandwidth unknown (the probe did not run)" in capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["bandwidth_gbs"] is None and rep["limit_ms"] is None and rep["dot_peak"] is None


def test_the_probes_on_aarch64(tmp_path, capsys, monkeypatch):
    """read_bw.c builds for aarch64 (the line as a GCC vector: NEON loads) and runs (under qemu-user on
    x86 machines); dot_peak.c, x86 only, stops at an #error that says so, and the bench prints it and
    goes on without the numbers (runtime._run_probe returns None)."""
    import shutil
    import subprocess
    from pathlib import Path

    from specdec.tools.bench import runtime
    csrc = Path(runtime.__file__).parent / "csrc"
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cc:
        err = subprocess.run([cc, "-O3", "-fopenmp", str(csrc / "dot_peak.c"), "-o", str(tmp_path / "dp")],
                             capture_output=True, text=True).stderr
        assert "no probe for this architecture yet" in err
        subprocess.run([cc, "-O3", "-march=armv8-a", "-fopenmp", str(csrc / "read_bw.c"), "-o", str(tmp_path / "rb")],
                       check=True, capture_output=True)
        if qemu:
            r = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(tmp_path / "rb"), "0.01", "1"],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and float(r.stdout.split()[0]) > 0

    def fails(cmd, **kw):
        raise subprocess.CalledProcessError(1, cmd, stderr='dot_peak.c:10:2: error: #error "dot_peak.c times x86 '
                                                          'instructions ...: no probe for this architecture yet"\n')
    monkeypatch.setattr(runtime.subprocess, "run", fails)
    assert runtime.dot_peak() is None
    err = capsys.readouterr().err
    assert "the dot_peak probe (csrc/dot_peak.c) does not run" in err and "no probe for this architecture yet" in err


def test_the_gpu_mode_says_what_it_needs(tiny_shape, monkeypatch):
    """``--device cuda``: a clear exit where there is no GPU or the request cannot run there (the GPU
    mode times random weights of a shape, whole and in bf16: scripts/cuda_checks.sh)."""
    monkeypatch.setattr(step.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        step.main(["--shape", tiny_shape, "--device", "cuda"])
    monkeypatch.setattr(step.torch.cuda, "is_available", lambda: True)
    for extra in (["--quantization", "int4"], ["--slices", "2,4"], []):
        args = ["--shape", tiny_shape] if extra != [] else ["--model", "smollm2-135m"]
        with pytest.raises(SystemExit, match="random weights of a --shape, whole and in bf16"):
            step.main(args + extra + ["--device", "cuda"])


@pytest.mark.skipif(not step.torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_shape_times_on_the_gpu(tiny_shape, tmp_path):
    out = tmp_path / "gpu.json"
    assert step.main(["--shape", tiny_shape, "--device", "cuda", "--rows", "1,4", "--repeats", "2",
                      "--context", "8", "--output", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["device"] == "cuda" and rep["bandwidth_gbs"] > 0
    assert set(rep["rows"]) == {"eager/1", "eager/4", "graphs/1", "graphs/4"}  # the eager path and CUDA graphs


def test_paths_are_those_of_the_device(tiny_shape):
    """The CPU times the native and PyTorch paths, a GPU the eager one and CUDA graphs: another name is refused."""
    for device, bad in (("cpu", "graphs"), ("cpu", "native,gpu"), ("cuda", "native")):
        with pytest.raises(SystemExit, match=f"--paths on {device}: one or both of"):
            step.main(["--shape", tiny_shape, "--device", device, "--paths", bad])


def test_a_draft_head_reads_only_its_rows(tiny_model_dir, tmp_path, monkeypatch):
    """``--draft-vocab N``: the head cut to N rows as a drafter's draft_vocab_size cuts it, so the bytes
    a forward reads drop by exactly the other rows (it would catch a cut that kept the full head
    behind, or counted both); a shape (no tokenizer) or N <= 0 is refused with a clear exit."""
    import numpy as np

    from specdec.heads import token_freq
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(token_freq, "shipped_ranking", lambda hf: np.arange(vocab)[::-1].copy())
    full, cut = tmp_path / "full.json", tmp_path / "cut.json"
    args = ["--model", str(tiny_model_dir), "--rows", "1", "--repeats", "1", "--context", "8", "--paths", "torch"]
    monkeypatch.setattr(step, "read_bandwidth_avx512", lambda *a, **k: 10.0)
    monkeypatch.setattr(step, "dot_peak", lambda: None)
    assert step.main(args + ["--output", str(full)]) == 0
    assert step.main(args + ["--draft-vocab", "100", "--output", str(cut)]) == 0
    a, b = json.loads(full.read_text()), json.loads(cut.read_text())
    hidden = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    assert a["bytes"] - b["bytes"] == (vocab - 100) * hidden * 2  # bf16 rows of the head
    assert b["model"].endswith("(100-token draft head)") and b["rows"]["torch/1"]["ms"] > 0
    for bad in (["--shape", "qwen2.5-0.5b", "--draft-vocab", "100"], ["--model", "x", "--draft-vocab", "0"]):
        with pytest.raises(SystemExit, match="--draft-vocab N"):
            step.main(bad)
