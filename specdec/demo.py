"""`specdec demo`: plain and speculative greedy decoding of one prompt, side by side, explained.

Speculative decoding (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al., 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): a cheap drafter proposes K tokens, the target scores all of them in one forward pass and
keeps the longest prefix it agrees with, plus one token of its own. Greedy output is therefore the
target's own, token for token; the demo checks that and shows, on a terminal, which tokens of the
answer came from accepted drafts.

The demo prints a few lines a person reads at a glance: the prompt, the models, the method and its
settings, the answer (ended at the model's end of turn, or marked as cut), plain and speculative
speed, acceptance, tokens per target step, and the identical-tokens check.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from specdec.errors import SpecdecError

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEMO_PROMPT = ("Write a Python function is_palindrome(s) that ignores case and punctuation, with a short "
               "docstring. Reply with the code only.")
NO_QUANTIZATION = ("none", "bf16")


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdec demo` (methods come from the registry)."""
    from specdec.proposers.registry import DEFAULT_WITH_MODEL, METHODS  # noqa: PLC0415

    d = sub.add_parser("demo", help="plain vs speculative decoding of one prompt, side by side, explained",
                       description="Decode one chat prompt plainly, then speculatively, and show the answer, "
                                   "both speeds, the acceptance and whether the tokens are identical.")
    d.add_argument("--model", default=DEFAULT_TARGET,
                   help=f"target: embedded name, HF directory or .gguf file (default {DEFAULT_TARGET})")
    d.add_argument("--method", default=DEFAULT_WITH_MODEL, choices=tuple(METHODS),
                   help=f"speculation method (`specdec methods` lists them; default {DEFAULT_WITH_MODEL})")
    d.add_argument("--draft", default=DEFAULT_DRAFT,
                   help=f"draft model, for methods that take one (default {DEFAULT_DRAFT})")
    d.add_argument("--draft-quantization", default="int4", choices=("int4", "int8", "gguf", *NO_QUANTIZATION),
                   help="the draft's weights, for methods that take a quantization: int4, int8 (our codes, made "
                        "in memory from a GGUF file's weights), gguf (a GGUF file's own blocks) or none (its "
                        "default: gguf for a GGUF file or an embedded model, else bfloat16). Default int4: the "
                        "fastest draft measured (BENCHMARKS.md, 2026-12-07)")
    d.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=2,
                   help="draft length K: tokens drafted per target step (default 2: the fastest measured with the "
                        "int4 draft on the file's own target blocks, BENCHMARKS.md)")
    d.add_argument("--prompt", default=DEMO_PROMPT, help="the user message (default: a short coding task)")
    d.add_argument("--max-tokens", type=int, default=512,
                   help="new tokens at most; an answer cut there is marked as cut (default 512)")
    d.set_defaults(func=cmd_demo)


def demo_config(method: str, draft: str, quantization: str | None, k: int) -> dict[str, Any]:
    """The speculative_config of ``method``: the draft model and quantization go to the methods whose
    options schema has those fields (no method is named here)."""
    from specdec.proposers.registry import schema  # noqa: PLC0415

    names = {f.name for f in schema(method).fields()}
    cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if "model" in names:
        cfg["model"] = draft
    if "quantization" in names and quantization is not None:
        cfg["quantization"] = quantization
    return cfg


def option_values(opts: Any) -> dict[str, Any]:
    """Every option of a parsed config that is set (None left out), by name."""
    values = dataclasses.asdict(opts)
    return {f.name: values[f.name] for f in dataclasses.fields(opts) if f.init and values[f.name] is not None}


def models_line(target: str, values: dict[str, Any]) -> str:
    """The target and, for methods with a draft model, the draft and its weights."""
    if "model" not in values:
        return f"target {target} ({weights(target, None)}); no second model"
    return f"target {target} ({weights(target, None)}), draft {values['model']} " \
           f"({weights(values['model'], values.get('quantization'))})"


def weights(model: str, quantization: str | None) -> str:
    """What a model's weights run as on the CPU: the quantization, else a GGUF file's (or an embedded model's)
    own blocks, else bfloat16 (``loader.model_quantization``; the demo asks for no dtype)."""
    from specdec.formats.hub import is_gguf  # noqa: PLC0415

    kind = quantization or ("gguf" if is_gguf(model) else None)
    return "the file's own blocks" if kind == "gguf" else kind or "bfloat16"


class DraftMarks:
    """An ``on_step`` callback recording, for each generated token, whether it was an accepted draft token.

    In each step the accepted draft tokens come first, then the target's own token (its correction
    or bonus), so the step's new tokens split by the change in the accepted count.
    """

    def __init__(self) -> None:
        self.from_draft: list[bool] = []
        self._accepted = 0

    def __call__(self, seqs: list) -> None:
        if not seqs:
            return
        s = seqs[0]
        new = len(s.output_ids) - len(self.from_draft)
        acc = min(s.num_accepted - self._accepted, new)
        self._accepted = s.num_accepted
        self.from_draft += [True] * acc + [False] * (new - acc)


def highlighted(tokenizer: Any, ids: list[int], from_draft: list[bool], text: str):  # -> rich.text.Text
    """The answer as rich Text with the accepted draft tokens highlighted (cut to ``text``'s length)."""
    from rich.text import Text  # noqa: PLC0415

    from specdec.formats.tokenizer import IncrementalDetokenizer  # noqa: PLC0415

    detok = IncrementalDetokenizer(tokenizer)
    pieces = [(detok.feed([tok]), drafted) for tok, drafted in zip(ids, from_draft)]
    pieces.append((detok.flush(), False))
    out, room = Text(), len(text)  # a stop string may have cut the text short of the tokens
    for piece, drafted in pieces:
        out.append(piece[:room], style="black on green" if drafted else "")
        room -= len(piece[:room])
    return out


def cmd_demo(a: argparse.Namespace) -> int:
    """Plain and speculative greedy decoding of one chat prompt; exit 1 if the tokens differ."""
    from specdec.config import SamplingParams  # noqa: PLC0415
    from specdec.llm import LLM  # noqa: PLC0415
    from specdec.proposers.registry import parse_config  # noqa: PLC0415

    quant = None if a.draft_quantization in NO_QUANTIZATION else a.draft_quantization
    opts = parse_config(demo_config(a.method, a.draft, quant, a.k))  # bad options fail before any loading
    if a.max_tokens < 1:
        raise SpecdecError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    values = option_values(opts)
    print(f"prompt:       {a.prompt}")
    print(f"models:       {models_line(a.model, values)}")
    print(f"method:       {opts.method}: {opts.summary}")
    print("settings:     " + ", ".join(f"{k}={v}" for k, v in values.items()), flush=True)
    print("loading (the first run downloads, checks and converts the models: see docs/getting-started.md)...",
          file=sys.stderr, flush=True)
    llm = LLM(model=a.model, speculative_config=opts)
    msgs = [{"role": "user", "content": a.prompt}]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    for k in (0, opts.num_speculative_tokens):  # warm-up both paths
        llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4), num_speculative_tokens=k)
    t0 = time.perf_counter()
    plain = llm.chat(msgs, params, num_speculative_tokens=0)[0]
    t_plain = time.perf_counter() - t0
    marks = DraftMarks()
    t0 = time.perf_counter()
    spec = llm.chat(msgs, params, on_step=marks)[0]
    t_spec = time.perf_counter() - t0
    print_answer(llm.tokenizer, spec, marks)
    return print_figures(plain, t_plain, spec, t_spec, opts.num_speculative_tokens)


def print_answer(tokenizer: Any, out: Any, marks: DraftMarks) -> None:
    """The speculative answer between rules; on a terminal, accepted draft tokens highlighted."""
    c = out.outputs[0]
    rule = "-" * 72
    if sys.stdout.isatty():
        from rich.console import Console  # noqa: PLC0415

        print(f"answer (highlighted: the draft's tokens the target accepted):\n{rule}", flush=True)
        Console(highlight=False, soft_wrap=True).print(highlighted(tokenizer, c.token_ids, marks.from_draft,
                                                                    c.text))
    else:
        print(f"answer:\n{rule}\n{c.text}")
    end = ("[cut at --max-tokens: raise it to see the rest]" if c.finish_reason == "length"
           else "[end of the answer]")
    print(f"{rule}\n{end}")


def print_figures(plain: Any, t_plain: float, spec: Any, t_spec: float, k: int) -> int:
    """Speeds, acceptance, tokens per step and the identical-tokens check; returns the exit status."""
    m = spec.metrics
    for name, out, secs in (("plain", plain, t_plain), ("speculative", spec, t_spec)):
        n = out.metrics.num_generated_tokens
        print(f"{name + ':':<13} {n} tokens in {secs:.2f} s = {n / secs:.2f} tok/s")
    print(f"speedup:      {t_plain / t_spec:.2f}x")
    print(f"acceptance:   {m.acceptance_rate:.0%} of {m.num_draft_tokens} drafted tokens")
    print(f"tokens/step:  {m.mean_accepted_length:.2f} per target forward pass (plain decoding: 1.00): "
          f"each pass checks up to {k} drafted tokens at once and keeps the accepted ones plus one of its own")
    same = plain.outputs[0].token_ids == spec.outputs[0].token_ids
    print("identical:    " + ("yes: the speculative tokens are the plain greedy tokens, one for one" if same
                              else "NO: the speculative tokens differ from plain decoding (a bug: please report it)"))
    return 0 if same else 1
