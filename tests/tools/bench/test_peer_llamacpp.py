"""llama.cpp peer: parsing its binaries' output (captured from the build that
scripts/build_llamacpp.sh makes: llama-cpp-python 0.3.36, llama.cpp 0c1e570), the command lines it runs,
the clear error when the binaries are missing, and (slow) a real run when they are built."""
from __future__ import annotations

import json
import os
import re
import stat
import sys

import pytest

from specdec.tools.bench import peer_llamacpp as pl
from specdec.config import SamplingParams
from specdec.errors import SpecdecError

# the Qwen2.5 chat template around the user turn "Say hi."
PROMPT = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
PROMPT_IDS = [151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264, 10950,
              17847, 13, 151645, 198, 151644, 872, 198, 45764, 15588, 13, 151645, 198, 151644, 77091, 198]

# llama-completion -m Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf -f prompt.txt -n 8 --ignore-eos --no-escape --temp 0
#     -t 1 -tb 1 -c 4096 -b 4096 -no-cnv --no-display-prompt --verbose-prompt
PLAIN_STDOUT = "Hello! How can I assist you today\n\n"
PLAIN_STDERR = """0.00.003.011 I llama_completion: llama backend init
0.00.004.000 I llama_completion: load the model and apply lora adapter, if any
0.00.293.470 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.00.706.982 I cmn          init: llama threadpool init, n_threads = 1
0.00.772.176 I 
0.00.772.294 I system_info: n_threads = 1 (n_threads_batch = 1) / 2 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | 
0.00.772.299 I 
0.00.772.524 I llama_completion: prompt: '<|im_start|>system
You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>
<|im_start|>user
Say hi.<|im_end|>
<|im_start|>assistant
'
0.00.772.530 I llama_completion: number of tokens in prompt = 32
0.00.772.534 I 151644 -> '<|im_start|>'
0.00.772.539 I   8948 -> 'system'
0.00.772.543 I    198 -> '
'
0.00.772.548 I   2610 -> 'You'
0.00.772.552 I    525 -> ' are'
0.00.772.556 I   1207 -> ' Q'
0.00.772.561 I  16948 -> 'wen'
0.00.772.565 I     11 -> ','
0.00.772.569 I   3465 -> ' created'
0.00.772.574 I    553 -> ' by'
0.00.772.578 I  54364 -> ' Alibaba'
0.00.772.583 I  14817 -> ' Cloud'
0.00.772.586 I     13 -> '.'
0.00.772.591 I   1446 -> ' You'
0.00.772.595 I    525 -> ' are'
0.00.772.599 I    264 -> ' a'
0.00.772.603 I  10950 -> ' helpful'
0.00.772.608 I  17847 -> ' assistant'
0.00.772.612 I     13 -> '.'
0.00.772.616 I 151645 -> '<|im_end|>'
0.00.772.620 I    198 -> '
'
0.00.772.624 I 151644 -> '<|im_start|>'
0.00.772.628 I    872 -> 'user'
0.00.772.632 I    198 -> '
'
0.00.772.636 I  45764 -> 'Say'
0.00.772.640 I  15588 -> ' hi'
0.00.772.644 I     13 -> '.'
0.00.772.648 I 151645 -> '<|im_end|>'
0.00.772.652 I    198 -> '
'
0.00.772.656 I 151644 -> '<|im_start|>'
0.00.772.661 I  77091 -> 'assistant'
0.00.772.665 I    198 -> '
'
0.00.772.669 I 
0.00.772.678 I sampler seed: 3476082507
0.00.772.692 I sampler params: 
\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, presence_penalty = 0.000
\tdry_multiplier = 0.000, dry_base = 1.750, dry_allowed_length = 2, dry_penalty_last_n = 64
\ttop_k = 40, top_p = 0.950, min_p = 0.050, xtc_probability = 0.000, xtc_threshold = 0.100, typical_p = 1.000, top_n_sigma = -1.000, temp = 0.000
\tmirostat = 0, mirostat_lr = 0.100, mirostat_ent = 5.000, adaptive_target = -1.000, adaptive_decay = 0.900
0.00.772.699 I sampler chain: logits -> logit-bias -> ?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> min-p -> ?xtc -> temp-ext -> dist 
0.00.772.704 I generate: n_ctx = 4096, n_batch = 4096, n_predict = 8, n_keep = 0
0.00.772.708 I 
0.01.408.158 I common_perf_print:    sampling time =       1.22 ms
0.01.408.169 I common_perf_print:    samplers time =       0.49 ms /    40 tokens
0.01.408.175 I common_perf_print:        load time =     528.44 ms
0.01.408.180 I common_perf_print: prompt eval time =     390.52 ms /    32 tokens (   12.20 ms per token,    81.94 tokens per second)
0.01.408.185 I common_perf_print:        eval time =     243.26 ms /     7 runs   (   34.75 ms per token,    28.78 tokens per second)
0.01.408.190 I common_perf_print:       total time =     636.00 ms /    39 tokens
0.01.408.194 I common_perf_print: unaccounted time =       1.00 ms /   0.2 %      (total - sampling - prompt eval - eval) / (total)
0.01.408.198 I common_perf_print:    graphs reused =          6
"""

# llama-speculative-simple -m Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf -f prompt.txt -n 7 --ignore-eos --no-escape
#     --temp 0 -t 1 -tb 1 -c 4096 -b 4096 -md Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --spec-type draft-simple
#     --spec-draft-n-max 3 --spec-draft-n-min 0 --spec-draft-p-min 0 -td 1 -tbd 1
SPEC_STDOUT = "\n\n" + PROMPT + "Hello! How can I assist you today? Is\n\n\n\n"
SPEC_STDERR = """0.00.441.867 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.00.845.860 I cmn          init: llama threadpool init, n_threads = 1
0.00.908.519 I common_speculative_init_result: loading draft model '/root/.cache/specdec/gguf/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf'
0.01.006.907 W load: control-looking token: 128247 '</s>' was not control-type; this is probably a bug in the model. its type will be overridden
0.02.600.583 I encoded   32 tokens in    0.673 seconds, speed:   47.537 t/s
0.02.600.593 I decoded   10 tokens in    0.711 seconds, speed:   14.056 t/s
0.02.600.597 I 
0.02.600.601 I n_draft   = 3
0.02.600.605 I n_predict = 10
0.02.600.609 I n_drafted = 8
0.02.600.613 I n_accept  = 7
0.02.600.618 I accept    = 87.500%
0.02.600.622 I 
0.02.600.626 I draft:

0.02.600.664 I 
0.02.600.667 I target:

0.02.600.673 I common_perf_print:    sampling time =       1.59 ms
0.02.600.677 I common_perf_print:    samplers time =       0.54 ms /    10 tokens
0.02.600.681 I common_perf_print:        load time =     513.20 ms
0.02.600.686 I common_perf_print: prompt eval time =    1150.73 ms /    44 tokens (   26.15 ms per token,    38.24 tokens per second)
0.02.600.691 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
0.02.600.695 I common_perf_print:       total time =    1692.20 ms /    45 tokens
0.02.600.700 I common_perf_print: unaccounted time =     539.88 ms /  31.9 %      (total - sampling - prompt eval - eval) / (total)
0.02.600.704 I common_perf_print:    graphs reused =          1
"""


# ---- parsing -------------------------------------------------------------------------------------
def test_parse_plain_reads_text_counts_and_timings():
    r = pl.parse_plain(PLAIN_STDOUT, PLAIN_STDERR)
    assert r["text"] == "Hello! How can I assist you today"
    assert r["num_generated"] == 8 and r["num_target_forwards"] == 8  # prefill + 7 eval runs
    assert r["prompt_tokens"] == 32 and r["prompt_ids"] == PROMPT_IDS
    assert r["seconds"] == pytest.approx(0.636)  # common_perf_print's total: prompt eval + eval + sampling
    assert r["prompt_seconds"] == pytest.approx(0.39052)
    assert r["decode_seconds"] == pytest.approx(0.24326 + 0.00122)
    assert r["decode_tokens_per_second"] == pytest.approx(28.78)


def test_parse_speculative_reads_text_counts_timings_and_acceptance():
    r = pl.parse_speculative(SPEC_STDOUT, SPEC_STDERR, PROMPT)
    assert r["text"] == "Hello! How can I assist you today? Is"
    assert r["num_generated"] == 10 and r["prompt_tokens"] == 32
    assert (r["n_drafted"], r["n_accepted"]) == (8, 7)
    assert r["num_target_forwards"] == 1 + 10 - 7  # prefill + one per draft/verify step
    assert r["seconds"] == pytest.approx(0.673 + 0.711)  # "encoded" + "decoded", not the draft's load
    assert r["prompt_seconds"] == pytest.approx(0.673) and r["decode_seconds"] == pytest.approx(0.711)
    assert r["decode_tokens_per_second"] == pytest.approx(14.056)


def test_parse_speculative_rejects_a_different_prompt_echo():
    with pytest.raises(SpecdecError, match="echoed a different prompt"):
        pl.parse_speculative(SPEC_STDOUT, SPEC_STDERR, PROMPT.replace("Say hi.", "Say bye."))


def test_parse_without_timings_is_a_one_line_error():
    with pytest.raises(SpecdecError, match="could not find the prompt eval time in llama-completion") as e:
        pl.parse_plain("Hello", "0.00.003.011 I llama_completion: llama backend init\n")
    assert "\n" not in str(e.value)
    with pytest.raises(SpecdecError, match="n_drafted"):
        pl.parse_speculative(SPEC_STDOUT, SPEC_STDERR.replace("n_drafted", "n_xxx"), PROMPT)


def test_parse_prompt_ids_without_verbose_prompt_is_none():
    assert pl.parse_prompt_ids(SPEC_STDERR) is None


def test_output_stats_are_llamacpps_own_figures_over_all_it_generated():
    out = pl.LlamaCppOutput([1] * 8, 1.1072, 3, num_generated=10, wall_seconds=1.384, target_forwards=4,
                            prompt_tokens=32, prompt_seconds=0.673, decode_seconds=0.711,
                            decode_tokens_per_second=14.056, n_drafted=8, n_accepted=7)
    s = out.stats()
    assert s["mean_accepted_length"] == pytest.approx(2.5) and s["acceptance_rate"] == pytest.approx(7 / 8)
    assert s["tokens_per_second"] == pytest.approx(10 / 1.384)
    assert "token_ids" not in s and json.dumps(s)


# ---- configs, errors -----------------------------------------------------------------------------
def test_peer_reason_covers_plain_and_draft_model_only():
    assert pl.peer_reason(None) is None
    assert pl.peer_reason({"method": "draft_model", "model": "qwen2.5-coder-0.5b"}) is None
    assert "ngram" in pl.peer_reason({"method": "ngram"})
    assert pl.peer_reason({"method": "draft_model", "model": "d", "adaptive": True}) is None


def test_confidence_threshold_becomes_llama_cpp_p_min(tmp_path):
    for name in (pl.PLAIN_TOOL, pl.SPEC_TOOL):
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    peer = pl.LlamaCppPeer(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf")
    spec = {"method": "draft_model", "adaptive": True, "draft_confidence_threshold": 0.4}
    cmd = peer.command(tmp_path / "p.txt", 10, spec, 3, 16)
    assert cmd[cmd.index("--spec-draft-p-min") + 1] == "0.4"
    cmd = peer.command(tmp_path / "p.txt", 10, {"method": "draft_model"}, 3, 16)
    assert cmd[cmd.index("--spec-draft-p-min") + 1] == "0"


def test_peer_configs_are_named_llama_cpp():
    from specdec.tools.bench.speculative import BenchConfig, peer_configs
    spec = {"method": "draft_model", "model": "qwen2.5-coder-0.5b"}
    configs = [BenchConfig("plain", None), BenchConfig("draft_model K=3", spec, 3),
               BenchConfig("ngram K=3", {"method": "ngram"}, 3)]
    out, notes = peer_configs(configs, "llamacpp")
    assert [(c.name, c.engine, c.counterpart) for c in out] == [
        ("llama.cpp plain", "llamacpp", "plain"), ("llama.cpp draft_model K=3", "llamacpp", "draft_model K=3")]
    assert len(notes) == 1 and notes[0].startswith("peer: ngram K=3 not run")


def test_missing_binaries_give_the_build_command(tmp_path):
    with pytest.raises(SpecdecError) as e:
        pl.check_bin_dir(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "scripts/build_llamacpp.sh" in msg and "llama-speculative-simple" in msg


def test_bench_with_missing_binaries_fails_fast_with_one_line(tmp_path, capsys):
    from specdec.cli import main
    rc = main(["bench", "--model", "qwen2.5-coder-1.5b", "--speculative-model", "qwen2.5-coder-0.5b",
               "--peer", "llamacpp", "--llamacpp-bin", str(tmp_path / "nowhere"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0
    assert err.startswith("error: llama.cpp binaries not found") and "scripts/build_llamacpp.sh" in err


def test_bench_peer_is_greedy_only(tmp_path, capsys):
    from specdec.cli import main
    rc = main(["bench", "--model", "m", "--speculative-model", "d", "--peer", "llamacpp",
               "--llamacpp-bin", str(tmp_path), "--temperature", "0.7", "--no-progress"])
    assert rc == 2 and "greedy decoding only" in capsys.readouterr().err


def test_gguf_path_of_a_file_and_of_an_unknown_name(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 16)
    assert pl.gguf_path(str(f)) == f
    with pytest.raises(SpecdecError, match="needs a GGUF file"):
        pl.gguf_path(str(tmp_path))


# ---- the peer against stand-in binaries that replay the captured output --------------------------
STUB = """#!{python}
import json, pathlib, sys
here, name, args = pathlib.Path(__file__).parent, pathlib.Path(sys.argv[0]).name, sys.argv[1:]
(here / (name + ".args.json")).write_text(json.dumps(args))
(here / (name + ".prompt")).write_bytes(pathlib.Path(args[args.index("-f") + 1]).read_bytes())
sys.stdout.write((here / (name + ".stdout")).read_text())
sys.stderr.write((here / (name + ".stderr")).read_text())
"""


class FakeTokenizer:
    """Stands in for the Qwen tokenizer: the captured prompt ids <-> the captured prompt text."""

    def decode(self, ids, skip_special_tokens=True):
        assert list(ids) == PROMPT_IDS and not skip_special_tokens
        return PROMPT

    def encode(self, text, add_special_tokens=True):
        """Words and punctuation, as Qwen splits the captured outputs (8 and 10 tokens)."""
        return [sum(map(ord, w)) for w in re.findall(r" ?\w+|[^\w\s]", text)]


@pytest.fixture()
def stub_bin(tmp_path):
    for tool, out, err in ((pl.PLAIN_TOOL, PLAIN_STDOUT, PLAIN_STDERR), (pl.SPEC_TOOL, SPEC_STDOUT, SPEC_STDERR)):
        exe = tmp_path / tool
        exe.write_text(STUB.format(python=sys.executable))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        (tmp_path / f"{tool}.stdout").write_text(out)
        (tmp_path / f"{tool}.stderr").write_text(err)
    return tmp_path


def _args(stub_bin, tool):
    return json.loads((stub_bin / f"{tool}.args.json").read_text())


def _flag(args, name):
    return args[args.index(name) + 1]


def test_generate_plain_passes_the_templated_text_and_greedy_flags(stub_bin, tmp_path):
    peer = pl.LlamaCppPeer(stub_bin, tmp_path / "t.gguf", tmp_path / "d.gguf", threads=2, tokenizer=FakeTokenizer())
    out = peer.generate(PROMPT_IDS, None, None, SamplingParams(temperature=0.0, max_tokens=8))
    assert out.text == "Hello! How can I assist you today" and out.token_ids == FakeTokenizer().encode(out.text)
    assert len(out.token_ids) == 8
    assert (out.num_generated, out.prompt_tokens, out.num_target_forwards) == (8, 32, 8)
    assert out.seconds == out.wall_seconds == pytest.approx(0.636)
    # -f drops one trailing newline: the file carries one more, so llama.cpp sees the exact text
    assert (stub_bin / f"{pl.PLAIN_TOOL}.prompt").read_text() == PROMPT + "\n"
    args = _args(stub_bin, pl.PLAIN_TOOL)
    assert _flag(args, "-n") == "8" and _flag(args, "--temp") == "0" and _flag(args, "-t") == "2"
    assert {"--ignore-eos", "--no-escape", "-no-cnv", "--no-display-prompt", "--verbose-prompt"} <= set(args)


def test_generate_draft_model_runs_speculative_simple_with_fixed_k(stub_bin, tmp_path):
    peer = pl.LlamaCppPeer(stub_bin, tmp_path / "t.gguf", tmp_path / "d.gguf", threads=2, tokenizer=FakeTokenizer())
    out = peer.generate(PROMPT_IDS, {"method": "draft_model"}, 3, SamplingParams(temperature=0.0, max_tokens=8))
    assert out.text == "Hello! How can I assist you today? Is"
    assert (out.num_generated, out.n_drafted, out.n_accepted, out.target_forwards) == (10, 8, 7, 4)
    # it overshot to 10 tokens: the bench gets the first 8, with time and forwards scaled to them,
    # so its tokens/s and mean accepted length are llama.cpp's own
    assert out.token_ids == FakeTokenizer().encode(out.text)[:8]
    assert out.seconds == pytest.approx((0.673 + 0.711) * 8 / 10) and out.wall_seconds == pytest.approx(1.384)
    assert len(out.token_ids) / out.seconds == pytest.approx(out.tokens_per_second)
    assert out.num_target_forwards == 3
    args = _args(stub_bin, pl.SPEC_TOOL)
    assert _flag(args, "-md") == str(tmp_path / "d.gguf") and _flag(args, "--spec-type") == "draft-simple"
    assert _flag(args, "--spec-draft-n-max") == "3" and _flag(args, "--spec-draft-p-min") == "0"
    assert _flag(args, "-n") == "7"  # asked for N-1, it ends with N..N+K tokens
    assert _flag(args, "-td") == "2" and "--ignore-eos" in args


def test_generate_rejects_sampling_and_a_different_prompt(stub_bin, tmp_path):
    peer = pl.LlamaCppPeer(stub_bin, tmp_path / "t.gguf", None, tokenizer=FakeTokenizer())
    with pytest.raises(SpecdecError, match="greedy decoding only"):
        peer.generate(PROMPT_IDS, None, None, SamplingParams(temperature=0.7, max_tokens=8))
    (stub_bin / f"{pl.PLAIN_TOOL}.stderr").write_text(PLAIN_STDERR.replace("/    32 tokens", "/    33 tokens"))
    with pytest.raises(SpecdecError, match="tokenized the prompt into 33 tokens, ours has 32"):
        peer.generate(PROMPT_IDS, None, None, SamplingParams(temperature=0.0, max_tokens=8))
    (stub_bin / f"{pl.PLAIN_TOOL}.stderr").write_text(PLAIN_STDERR.replace(" 15588 -> ' hi'", " 15589 -> ' hi'"))
    with pytest.raises(SpecdecError, match="tokenized the prompt into other ids than ours"):
        peer.generate(PROMPT_IDS, None, None, SamplingParams(temperature=0.0, max_tokens=8))


def test_a_failing_binary_is_a_one_line_error(stub_bin, tmp_path):
    (stub_bin / pl.PLAIN_TOOL).write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    peer = pl.LlamaCppPeer(stub_bin, tmp_path / "t.gguf", None, tokenizer=FakeTokenizer())
    with pytest.raises(SpecdecError, match=r"llama-completion exited with status 1 \(error: failed to load model\)"):
        peer.generate(PROMPT_IDS, None, None, SamplingParams(temperature=0.0, max_tokens=8))


# ---- the real binaries (slow; skipped unless built and the GGUF files are there) -----------------
def _real_setup():
    from specdec.formats import registry
    from specdec.home import specdec_home
    try:
        bin_dir = pl.check_bin_dir(pl.DEFAULT_BIN_DIR)
    except SpecdecError:
        return None
    home = specdec_home()
    entries = registry.embedded_models()
    files = [home / "gguf" / entries[n].gguf_file for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]
    model_dir = home / "models" / "qwen2.5-coder-1.5b"
    if not all(f.is_file() for f in files) or not (model_dir / "tokenizer.json").is_file():
        return None
    return bin_dir, files, model_dir


@pytest.mark.slow
def test_real_llamacpp_plain_and_speculative_on_our_prompt_ids():
    setup = _real_setup()
    if setup is None:
        pytest.skip(f"llama.cpp not built in {pl.DEFAULT_BIN_DIR} (scripts/build_llamacpp.sh) or Qwen GGUFs missing")
    bin_dir, (target, draft), model_dir = setup
    from specdec.formats.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python hello world."}])
    peer = pl.LlamaCppPeer(bin_dir, target, draft, threads=int(os.environ.get("LLAMACPP_THREADS", "2")), tokenizer=tok)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    plain = peer.generate(ids, None, None, params)  # prompt ids checked inside against llama.cpp's own
    assert plain.prompt_tokens == len(ids) and plain.num_generated == 8 and plain.seconds > 0
    assert tok.decode(plain.token_ids) == plain.text and len(plain.token_ids) == 8
    spec = peer.generate(ids, {"method": "draft_model"}, 3, params)
    assert spec.prompt_tokens == len(ids) and 8 <= spec.num_generated <= 8 + 3 and len(spec.token_ids) == 8
    assert spec.n_drafted >= spec.n_accepted >= 0 and 0 < spec.seconds <= spec.wall_seconds
    n = min(len(plain.text), len(spec.text), 10)
    assert plain.text[:n] == spec.text[:n]  # the same greedy start
