"""`specdec` on the command line: JSON output, streaming, and one-line errors with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec.errors import SpecdecError


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
    (["--prompt", "x", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompt", "x", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["--prompt", "word " * 300, "--max-model-len", "64"], "context is 64 tokens"),
    (["--prompt", "x", "--dtype", "int3"], "unknown dtype"),
    (["--prompt", "x", "--regex", "a+", "--choice", "a"], "at most one of --json-schema, --json-object, --regex"),
    (["--prompt", "x", "--json-schema", "/nonexistent/schema.json"], "--json-schema: cannot read"),
    (["--prompt", "x", "--json-schema", '{"type": '], "--json-schema: not valid JSON"),
    (["--prompt", "x", "--grammar", "/nonexistent/g.lark"], "--grammar: cannot read"),
    (["--prompt", "x", "--regex", "(("], "invalid structured output (regex)"),
])
def test_bad_input_gets_one_line_error(tiny_model_dir, args, needle):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    r = run_cli("generate", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_generate_structured_output(tiny_model_dir, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for flags in (["--json-schema", str(path), "--chat"], ["--json-schema", json.dumps(schema)]):
        r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "A name and a digit:", "--max-tokens",
                    "60", "--dtype", "float32", "--json", *flags)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out["text"]), schema)
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "Yes or no?", "--choice", "yes", "--choice",
                "no", "--temperature", "1", "--seed", "0")
    assert r.returncode == 0 and r.stdout in ("yes\n", "no\n"), r.stderr


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
    (["--speculative-method", "cascade-self"], {"method": "cascade-self"}),
    (["--speculative-method", "cascade", "--speculative-model", "m2", "--stage-tokens", "2"],
     {"method": "cascade", "model": "m2", "stage_tokens": 2}),
    (["--speculative-model", "m2", "--draft-context", "64"], {"method": "draft_model", "model": "m2", "draft_context": 64}),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--adaptive"],
     {"method": "ngram", "num_speculative_tokens": 3, "adaptive": True}),
])
def test_speculative_flags_make_the_config(flags, want):
    from specdec.args import speculative_config
    from specdec.cli import build_parser
    a = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flags])
    cfg = speculative_config(a)
    assert {k: cfg[k] for k in want} == want
    assert "skip_ratio" not in cfg or "skip_ratio" in want  # the schema picks the default


@pytest.mark.parametrize("flags,needle", [
    (["--speculative-method", "ngram", "--skip-ratio", "0.3"], "'ngram' takes no --skip-ratio"),
    (["--speculative-method", "draft_model"], "needs 'model'"),
    (["--speculative-method", "ngram", "--prompt-lookup-min", "0"], "prompt_lookup_min .* must be in \\[1, 64\\]"),
    (["--skip-ratio", "0.3"], "no method"),
])
def test_bad_speculative_flags_are_one_line_errors(flags, needle):
    import re
    from specdec.args import speculative_config
    from specdec.cli import build_parser
    a = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *flags])
    with pytest.raises(SpecdecError) as e:
        speculative_config(a)
    assert re.search(needle, str(e.value)), str(e.value)


def test_methods_lists_every_option_and_the_docs_page_is_current():
    from pathlib import Path
    from specdec.docs import METHODS_PAGE, methods_list
    from specdec.proposers.options import markdown_table
    from specdec.proposers.registry import schemas
    r = run_cli("methods")
    table = markdown_table(schemas())
    assert r.returncode == 0 and table in r.stdout and methods_list() in r.stdout
    page = (Path(__file__).resolve().parents[1] / METHODS_PAGE).read_text()
    assert table in page, "docs/methods.md is stale: run `python scripts/gen_docs.py`"


def test_generate_with_the_quantized_self_draft(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "def f(x): return x def f(x):",
                "--max-tokens", "12", "--ignore-eos", "--dtype", "float32", "--json",
                "--speculative-method", "cascade-self", "--num-speculative-tokens", "4")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 12 and out["metrics"]["num_draft_tokens"] > 0


def test_huge_seed_and_tiny_temperature(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "x", "--seed", "1180591620717411303424")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "seed must be an integer in [0, 2**64)" in r.stderr
    outs = []
    for t in ("1e-40", "0"):  # below 1e-5 a temperature is greedy (vLLM's rule), not overflowing noise
        r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "def fibonacci(n):", "--max-tokens",
                    "8", "--ignore-eos", "--temperature", t, "--json")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1]


def test_generate_ends_its_output_with_a_newline(tiny_model_dir):
    r = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "def fibonacci(n):", "--max-tokens", "5",
                "--ignore-eos")
    assert r.returncode == 0 and r.stdout.endswith("\n"), r.stdout


def help_entries(text: str) -> list[tuple[str, str]]:
    """(invocation, help) of each argument listed in an argparse --help text."""
    import re
    entries: list[list[str]] = []
    listing = False
    for line in text.splitlines():
        if line and not line.startswith(" "):  # a section header ("options:") or description text
            listing = line.endswith(":") and not line.startswith("usage:")
            continue
        if not listing or not line.strip():
            continue
        if re.match(r"  \S", line):
            entries.append((re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""])[:2])
        elif entries:
            entries[-1][1] = (entries[-1][1] + " " + line.strip()).strip()
    return [(inv, help_) for inv, help_ in entries]


@pytest.mark.parametrize("command", ["generate", "pull", "demo", "cache", "methods", "bench", "serve", "tune"])
def test_every_option_has_help_and_its_default(command, capsys):
    import re
    from specdec.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    entries = help_entries(capsys.readouterr().out)
    assert entries
    for inv, help_ in entries:
        assert help_, f"specdec {command} {inv}: no help text"
        takes_value = re.search(r"(^|[ ,])--?[\w-]+ ([A-Z][A-Z_]*|\{)", inv)
        if takes_value and not inv.startswith("-h"):
            assert re.search(r"(?i)default|required", help_), f"specdec {command} {inv}: help names no default"


def write_config(path, **fields):
    path.write_text(json.dumps({"specdec_config": 1, **fields}))
    return path


def test_generate_with_a_deployment_config(tiny_model_dir, tmp_path):
    cfg = write_config(tmp_path / "specdec-config.json", model=str(tiny_model_dir), dtype="float32",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3}, spec_max_batch=4)
    prompt = ["--prompt", "def f(x): return x def f(x): return x def f(x):", "--max-tokens", "10", "--ignore-eos",
              "--json"]
    r = run_cli("generate", "--config", str(tmp_path), *prompt)  # a directory: its specdec-config.json
    assert r.returncode == 0, r.stderr
    tuned = json.loads(r.stdout)
    assert tuned["metrics"]["num_draft_tokens"] > 0
    r = run_cli("generate", "--model", str(tiny_model_dir), "--dtype", "float32", *prompt)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == tuned["token_ids"]
    r = run_cli("generate", "--config", str(cfg), "--model", "no-such-model", *prompt)  # flags win
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr


@pytest.mark.parametrize("fields,needle", [
    (None, "give --model or --config"),
    ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 0}}, "prompt_lookup_min"),
    ({"spec_max_batch": 0}, "'spec_max_batch' must be an integer >= 1"),
    ({"modle": "x"}, "unknown key 'modle'"),
    ({"dtype": "float32"}, "the config names no model: give --model"),
])
def test_bad_deployment_configs_get_one_line_errors(tmp_path, fields, needle):
    args = ["generate", "--prompt", "x"]
    if fields is not None:
        args += ["--config", str(write_config(tmp_path / "c.json", **fields))]
    r = run_cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    (tmp_path / "broken.json").write_text('{"specdec_config": 1,\n "model": }')
    r = run_cli("generate", "--config", str(tmp_path / "broken.json"), "--prompt", "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not valid JSON" in r.stderr and "line 2" in r.stderr


def test_serve_takes_its_settings_from_the_config_unless_flags_are_given(tiny_model_dir, tmp_path, monkeypatch):
    import specdec.server.app as app
    from specdec.cli import main
    from specdec.server import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_SPEC_MAX_BATCH
    started = []
    monkeypatch.setattr(app, "create_app", lambda llm, config: (llm, config))
    monkeypatch.setattr(app, "serve", lambda built, *rest: started.append(built))
    cfg = write_config(tmp_path / "c.json", model=str(tiny_model_dir), dtype="float32",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3}, spec_max_batch=3,
                       max_prefill_tokens=64)

    def serve(*flags):
        assert main(["serve", *flags]) == 0
        return started.pop()

    llm, config = serve("--config", str(cfg))
    assert (config.spec_max_batch, config.max_prefill_tokens) == (3, 64)
    assert (llm.spec_max_batch, llm.max_prefill_tokens, llm.runner.prefill_chunk) == (3, 64, 64)
    assert llm.num_speculative_tokens == 3 and config.model_name == str(tiny_model_dir)
    assert str(llm.dtype) == "torch.float32"
    llm, config = serve("--config", str(cfg), "--spec-max-batch", "6", "--max-prefill-tokens", "0",
                        "--speculative-method", "ngram", "--num-speculative-tokens", "2", "--served-model-name", "x")
    assert (config.spec_max_batch, config.max_prefill_tokens, llm.max_prefill_tokens) == (6, None, None)
    assert llm.num_speculative_tokens == 2 and config.model_name == "x"
    llm, config = serve("--model", str(tiny_model_dir), "--dtype", "float32")  # no config: the old defaults
    assert (config.spec_max_batch, config.max_prefill_tokens) == (DEFAULT_SPEC_MAX_BATCH, DEFAULT_MAX_PREFILL_TOKENS)
    assert llm.speculative_method is None and llm.spec_max_batch == DEFAULT_SPEC_MAX_BATCH


def test_serve_refuses_a_bad_traffic_recording_before_loading_the_model(tmp_path, capsys):
    from specdec.cli import main
    (tmp_path / "file").write_text("")
    assert main(["serve", "--model", "no-such-model", "--record-traffic-mb", "0"]) == 2
    assert "--record-traffic-mb must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--model", "no-such-model", "--record-traffic", str(tmp_path / "file" / "d")]) == 2
    assert "cannot create the traffic directory" in capsys.readouterr().err


def test_serve_checks_the_prefill_slowdown_and_paces_native_prompts(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """``--prefill-slowdown``: > 1 or 0 (off), else a clear error before loading; on the native path
    (bf16) the server prefills every prompt in pieces of one batch-invariant product, so they ride the
    decode steps; elsewhere (fp32) in ``--max-prefill-tokens`` pieces, as before."""
    from specdec.cli import main
    from specdec.server import app
    for bad in ("1.0", "0.5", "-2", "nan"):
        assert main(["serve", "--model", "no-such-model", "--prefill-slowdown", bad]) == 2
        assert "--prefill-slowdown must be > 1 (or 0: off)" in capsys.readouterr().err
    started = []
    monkeypatch.setattr(app, "create_app", lambda llm, config: (llm, config))
    monkeypatch.setattr(app, "serve", lambda built, *rest: started.append(built))
    assert main(["serve", "--model", str(tiny_model_dir), "--dtype", "bfloat16"]) == 0
    llm, _ = started.pop()
    assert llm.prefill_slowdown == 1.5 and llm.runner.prefill_chunk == 32
    assert llm.engine().pacer is not None and llm.engine().pacer.quantum == 1  # cut anywhere
    assert main(["serve", "--model", str(tiny_model_dir), "--dtype", "float32", "--prefill-slowdown", "0",
                 "--max-prefill-tokens", "256"]) == 0
    llm, _ = started.pop()
    assert llm.prefill_slowdown is None and llm.runner.prefill_chunk == 256 and llm.engine().pacer is None
