"""`specdec` on the command line: JSON output, streaming, and one-line errors with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args: str, home=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["SPECDEC_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_generate_json(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "def fibonacci(n):",
                "--max-tokens", "7", "--ignore-eos", "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 7 and isinstance(out["text"], str)
    for key in ("tokens_per_second", "num_generated_tokens", "prefill_seconds", "decode_seconds",
                "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "acceptance_by_position"):
        assert key in out["metrics"]
    assert out["metrics"]["num_generated_tokens"] == 7


def test_generate_streams_text_and_reports_timing(tiny_model_dir, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello")
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt-file", str(prompt), "--chat",
                "--max-tokens", "5", "--ignore-eos", "--temperature", "0.8", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "finish: length" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--model", "no-such-model", "--prompt", "x"], "unknown model 'no-such-model'"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["--prompt", "word " * 300, "--max-model-len", "64"], "context is 64 tokens"),
    (["--prompt", "x", "--dtype", "int3"], "unknown dtype"),
])
def test_bad_input_gets_one_line_error(tiny_model_dir, args, needle):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    r = run_cli("generate", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_truncated_gguf_gets_one_line_error_and_leaves_no_cache(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x05" * 40)
    home = tmp_path / "home"
    r = run_cli("generate", "--model", str(bad), "--prompt", "x", home=home)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not a valid GGUF file" in r.stderr
    models = home / "models"
    assert not models.exists() or not any(models.iterdir())


def test_pull_unknown_name():
    r = run_cli("pull", "nope")
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr


@pytest.mark.parametrize("flags,want", [
    (["--speculative-method", "layer_skip", "--speculative-quantization", "int4"],
     {"method": "layer_skip", "quantization": "int4"}),
    (["--speculative-method", "layer_skip", "--skip-ratio", "0.3", "--search-steps", "16"],
     {"method": "layer_skip", "skip_ratio": 0.3, "search_steps": 16}),
    (["--speculative-method", "cascade-self"],
     {"method": "cascade", "stages": [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 4},
                                      {"method": "layer_skip", "quantization": "int4"}]}),
])
def test_speculative_flags_make_the_config(flags, want):
    from specdec.cli import build_parser, speculative_config
    a = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flags])
    cfg = speculative_config(a)
    assert {k: cfg[k] for k in want} == want
    assert "skip_ratio" not in cfg or "skip_ratio" in want  # the registry picks the default


def test_generate_with_the_quantized_self_draft(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "def f(x): return x def f(x):",
                "--max-tokens", "12", "--ignore-eos", "--dtype", "float32", "--json",
                "--speculative-method", "cascade-self", "--num-speculative-tokens", "4")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 12 and out["metrics"]["num_draft_tokens"] > 0
