"""Speculative vs plain decoding, side by side in one run, per category, method and draft length K.

    specdec bench --model qwen2.5-coder-1.5b --speculative-model qwen2.5-coder-0.5b \\
        --num-speculative-tokens 3 5 --max-tokens 128 --output results/bench.json --plots results/plots

For every prompt, plain decoding and each configuration run back to back (their order rotated from
prompt to prompt, so machine drift falls on all alike) after one warm-up per configuration. Greedy
outputs must be identical to plain decoding: a mismatch is reported in the tables and results.json
and makes the command exit with status 1. ``--peer hf`` adds transformers' own plain and assisted
generation to the same rotation (see ``peer_hf.py``); ``--peer llamacpp`` adds llama.cpp's own plain and
speculative binaries on the same GGUF files (see ``peer_llamacpp.py``; build them with
scripts/build_llamacpp.sh).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

from specdec.tools.bench.prompts import (MT_BENCH, BenchPrompt, load_prompts as load_prompt_file, parse_categories,
                                   read_prompt_file, select, spec_bench_category)
from specdec.args import speculative_config
from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.proposers.registry import DEFAULT_WITH_MODEL, parse_config, schema

__all__ = ["MT_BENCH", "spec_bench_category", "BenchConfig", "run", "cmd_bench"]

CODE_PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a binary search function in Python with type hints and a short test.",
    "Write a Python function that counts word frequencies in a text file and returns the top 10.",
    "Implement quicksort in Python and explain its complexity in a comment.",
    "Write a Python dataclass for a 2D point with distance and midpoint methods.",
    "Write a Python function that validates an email address with a regular expression.",
]


class BenchConfig(NamedTuple):
    """One column of the comparison. ``spec`` None is plain decoding; ``k`` overrides the config's
    draft length; ``engine`` is "specdec", "hf" or "llamacpp"."""

    name: str
    spec: dict | None
    k: int | None = None
    engine: str = "specdec"
    counterpart: str | None = None  # for the peer: our config it mirrors

    @property
    def method(self) -> str:
        return "plain" if self.spec is None else self.spec["method"]


PEERS = {"hf": ("specdec.tools.bench.peer_hf", "hf", "transformers'"),
         "llamacpp": ("specdec.tools.bench.peer_llamacpp", "llama.cpp", "llama.cpp's")}  # module, prefix, label


def peer_configs(configs: list[BenchConfig], engine: str = "hf") -> tuple[list[BenchConfig], list[str]]:
    """The peer's mirror of each of our configs it can run, plus notes on those it cannot."""
    import importlib  # noqa: PLC0415
    module, prefix, _ = PEERS[engine]
    peer_reason = importlib.import_module(module).peer_reason
    out, notes = [], []
    for c in configs:
        reason = peer_reason(c.spec)
        if reason:
            notes.append(f"peer: {c.name} not run: {reason}")
        else:
            out.append(BenchConfig(f"{prefix} {c.name}", c.spec, c.k, engine, c.name))
    return out, notes


def prompt_ids(tokenizer, prompt: BenchPrompt, turn_msgs: list[dict] | None) -> list[int]:
    """The token ids a bench run feeds for ``prompt``: its raw text, or the chat turns so far."""
    if turn_msgs is None:
        return tokenizer.encode(prompt.prompt)
    return tokenizer.apply_chat_template(turn_msgs)


def run_one(llm, peer, prompt: BenchPrompt, cfg: BenchConfig, params: SamplingParams,
            all_turns: bool = False) -> dict:
    """One prompt under one config (every turn when ``all_turns``, each after the model's own answer)."""
    from specdec.metrics import aggregate  # noqa: PLC0415
    turns = (prompt.turns if all_turns else prompt.turns[:1]) if prompt.is_chat else (None,)
    msgs: list[dict] = []
    ids: list[int] = []
    texts, metrics, wall, forwards, peer_stats = [], [], 0.0, 0, []
    if cfg.engine == "specdec":
        llm.set_speculative_config(cfg.spec)
    for turn in turns:
        if turn is not None:
            msgs.append({"role": "user", "content": turn})
        ids_in = prompt_ids(llm.tokenizer, prompt, msgs if turn is not None else None)
        if cfg.engine == "specdec":
            t0 = time.perf_counter()
            out = llm.generate(ids_in, params, num_speculative_tokens=cfg.k)[0]
            wall += time.perf_counter() - t0
            out_ids, text = out.outputs[0].token_ids, out.outputs[0].text
            metrics.append(out.metrics)
        else:
            res = peer.generate(ids_in, cfg.spec, cfg.k, params)
            wall += res.seconds
            forwards += res.num_target_forwards
            if hasattr(res, "stats"):  # llama.cpp's own figures (timings, draft counts)
                peer_stats.append(res.stats())
            out_ids, text = res.token_ids, llm.tokenizer.decode(res.token_ids)
        ids += out_ids
        texts.append(text)
        if turn is not None:
            msgs.append({"role": "assistant", "content": text})
    rec = {"wall_seconds": wall, "num_tokens": len(ids), "tokens_per_second": len(ids) / wall if wall > 0 else 0.0,
           "texts": texts, "token_ids": ids}
    if cfg.engine == "specdec":
        rec["metrics"] = aggregate(metrics).to_dict()
    else:
        rec["num_target_forwards"] = forwards
        if peer_stats:
            rec["peer_stats"] = peer_stats
    return rec


# the warm-up's question is none of the measured ones: nothing it leaves behind (a prefix in the
# cache, an answer in a suffix tree of past outputs) can favour a measured run
WARM_UP = BenchPrompt(index=-1, question_id="warm-up", category="warm-up",
                      turns=("Name three colours of the rainbow, in a short sentence.",))
WARM_UP_RAW = BenchPrompt(index=-1, question_id="warm-up", category="warm-up",
                          prompt="Three colours of the rainbow are")


def run(llm, prompts: list[BenchPrompt], configs: list[BenchConfig], max_tokens: int, *,
        temperature: float = 0.0, seed: int = 0, peer=None, all_turns: bool = False,
        progress: bool = True, ignore_eos: bool = False) -> list[dict]:
    """One record per (prompt, config). Each engine's first config must be its plain decoding.

    Greedy outputs are compared with the same engine's plain output (``identical_to_plain``);
    sampled ones are not (None): they legitimately differ.
    """
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415
    configs = [BenchConfig(*c) for c in configs]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos)
    warm = params.replace(max_tokens=min(8, max_tokens))
    bases = {c.engine: c.name for c in reversed(configs) if c.spec is None}
    records = []
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("warm-up", total=len(configs) * (len(prompts) + 1))
        for c in configs:  # warm-up every path (and load every draft) before timing
            bar.update(task, description=f"warm-up {c.name}")
            run_one(llm, peer, WARM_UP if prompts[0].is_chat else WARM_UP_RAW, c, warm)
            bar.advance(task)
        for i, prompt in enumerate(prompts):
            shift = i % len(configs)
            outs = {}
            for c in configs[shift:] + configs[:shift]:
                bar.update(task, description=f"{prompt.category} #{prompt.question_id}: {c.name}")
                outs[c.name] = run_one(llm, peer, prompt, c, params, all_turns)
                bar.advance(task)
            for c in configs:
                rec = outs[c.name]
                base = outs[bases[c.engine]]["token_ids"] if c.engine in bases else None
                same = rec["token_ids"] == base if params.greedy and base is not None else None
                records.append({"prompt_index": prompt.index, "question_id": prompt.question_id,
                                "category": prompt.category, "subcategory": prompt.subcategory,
                                "config": c.name, "engine": c.engine, "method": c.method,
                                "k": c.k if c.k is not None else (c.spec or {}).get("num_speculative_tokens"),
                                "counterpart": c.counterpart, "identical_to_plain": same, **rec})
    return records


def sweep_configs(a: argparse.Namespace) -> list[BenchConfig]:
    """Plain decoding, then every (method, K) the flags ask for; one speculative_config per method."""
    methods = list(dict.fromkeys(a.speculative_method or ([DEFAULT_WITH_MODEL] if a.spec_model else [])))
    if not methods:
        raise SpecdecError("nothing to compare with plain decoding: give --speculative-model DRAFT "
                           "or --speculative-method NAME")
    ks = list(dict.fromkeys(a.num_speculative_tokens))
    bad = [k for k in ks if not 1 <= k <= 32]
    if bad:
        raise SpecdecError(f"--num-speculative-tokens must be from 1 to 32, got {bad[0]}")
    topks = list(dict.fromkeys(getattr(a, "spec_tree_topk", None) or [None]))
    own = method_options(getattr(a, "method_option", []), methods)
    configs = [BenchConfig("plain", None)]
    for m in methods:
        for t in (topks if "tree_topk" in {f.name for f in schema(m).fields()} else [None]):
            flags = vars(a) | {"num_speculative_tokens": max(ks), "spec_tree_topk": t}
            spec = speculative_config(argparse.Namespace(**flags), method=m, strict=False) | own.get(m, {})
            parse_config(spec)  # a bad --method-option fails here, named
            tk = spec.get("tree_topk")
            shape = f" tree top-{tk}" if tk else " chain" if len(topks) > 1 and t == 0 else ""
            # each K its own config, so its own proposer: one with memory across requests (suffix's
            # tree of past outputs) must not draft from another configuration's answer to the same
            # prompt (the draft models themselves still load once)
            configs += [BenchConfig(f"{m} K={k}{shape}{' adaptive' if spec.get('adaptive') else ''}",
                                    spec | {"num_speculative_tokens": k}, k) for k in ks]
    return configs


def method_options(items: list[str], methods: list[str]) -> dict[str, dict]:
    """``--method-option METHOD.OPTION=VALUE`` items -> {method: {option: value}} (VALUE read as JSON
    where it parses, else kept as a string)."""
    out: dict[str, dict] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        m, dot, opt = key.partition(".")
        if not (eq and dot and opt):
            raise SpecdecError(f"--method-option {item!r}: expected METHOD.OPTION=VALUE, e.g. eagle.model=DIR")
        if m not in methods:
            raise SpecdecError(f"--method-option {item!r}: {m!r} is not among --speculative-method "
                               f"({', '.join(methods)})")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(m, {})[opt] = value
    return out


def peer_agreement(records: list[dict], engine: str = "hf") -> str:
    """How often the peer's plain greedy output equals ours: a check that both run the same model
    on the same tokens (bf16 kernels differ, so long outputs may part after a near tie)."""
    ours = {r["prompt_index"]: r["token_ids"] for r in records if r["engine"] == "specdec" and r["method"] == "plain"}
    theirs = {r["prompt_index"]: r["token_ids"] for r in records if r["engine"] == engine and r["method"] == "plain"}
    same = sum(ours[i] == t for i, t in theirs.items())
    prefix = [next((j for j, (x, y) in enumerate(zip(ours[i], t)) if x != y), min(len(ours[i]), len(t)))
              for i, t in theirs.items()]
    return (f"peer check: {PEERS[engine][2]} plain greedy output equals ours on {same}/{len(theirs)} prompts "
            f"(mean common prefix {sum(prefix) / max(1, len(prefix)):.0f} tokens)")


def command_line(a: argparse.Namespace) -> str:
    """The command as typed when run as `specdec bench ...`; else rebuilt from the parsed flags."""
    if sys.argv[1:2] == ["bench"]:
        return shlex.join(["specdec", *sys.argv[1:]])
    words = ["specdec", "bench"]
    for key, value in vars(a).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        words.append("--" + key.replace("_", "-"))
        if isinstance(value, list):
            words += [str(v) for v in value]
        elif value is not True:
            words.append(str(value))
    return shlex.join(words)


def cmd_bench(a: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; 1 if a greedy output differed from plain decoding."""
    from rich.console import Console  # noqa: PLC0415
    from rich.markup import escape  # noqa: PLC0415
    from specdec.tools.bench import report  # noqa: PLC0415
    for flag in ("lengths", "styles"):
        if getattr(a, flag, None) is not None:
            raise SpecdecError(f"--{flag} goes with --long (long prompts): add --long, or drop --{flag}")
    a.output = a.output or "results/bench.json"
    if a.limit is not None and a.limit < 1:
        raise SpecdecError(f"--limit must be at least 1 (prompts per category), got {a.limit}")
    if a.max_tokens < 1:
        raise SpecdecError(f"--max-tokens must be at least 1, got {a.max_tokens}")
    SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed)  # validates
    configs = sweep_configs(a)
    if a.peer == "llamacpp":  # fail before loading any model
        from specdec.tools.bench.peer_llamacpp import check_bin_dir, check_greedy  # noqa: PLC0415
        check_greedy(a.temperature)
        check_bin_dir(a.llamacpp_bin)
    prompts = load_prompt_file(a.prompts, parse_categories(a.categories), a.limit)
    if a.plots:
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError as e:
            raise SpecdecError("--plots needs matplotlib: pip install matplotlib") from e
    for d in ([Path(a.plots)] if a.plots else []) + [Path(a.output).parent]:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot create directory '{d}': {e.strerror}") from e
    from specdec.llm import LLM  # noqa: PLC0415
    console = Console(width=None if sys.stdout.isatty() else 200)  # a file or pipe gets whole tables
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, seed=a.seed,
              quantization=a.quantization, progress=not a.no_progress)
    notes = []
    peer, runs = None, list(configs)
    if a.peer == "hf":
        from specdec.tools.bench.peer_hf import HFPeer  # noqa: PLC0415
        extra, notes = peer_configs(configs)
        tok = llm.tokenizer
        pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else min(tok.eos_token_ids)
        peer = HFPeer(a.model, llm.dtype, llm.device, sorted(tok.eos_token_ids), pad)
        runs += extra
        if llm.target.quantization:
            notes.append(f"peer: transformers' target runs in {llm.dtype}, ours as {llm.target.runs_as}")
        if a.spec_quantization:
            notes.append(f"peer: transformers' draft runs in {llm.dtype}, ours with {a.spec_quantization} "
                         "weights")
    elif a.peer == "llamacpp":
        from specdec.tools.bench.peer_llamacpp import ADAPTIVE_NOTE, make_peer  # noqa: PLC0415
        extra, notes = peer_configs(configs, "llamacpp")
        peer = make_peer(a.llamacpp_bin, a.model, extra, llm.tokenizer)
        runs += extra
        if any(c.spec and c.spec.get("adaptive") for c in extra):
            notes.append(ADAPTIVE_NOTE)
        notes.append(f"peer: llama.cpp runs the GGUF files as they are (quantized kernels), {peer.threads} threads, "
                     "EOS ignored; its tokens/s is over prompt eval + generation by its own timers (peer_stats in "
                     "the JSON)")
    greedy = a.temperature == 0.0
    notes.append("identity check: greedy outputs of every config compared token by token with plain decoding"
                 if greedy else f"identity check skipped: temperature {a.temperature} > 0, sampled outputs "
                 "legitimately differ from plain decoding (same distribution, other draws)")
    if any(p.is_chat and len(p.turns) > 1 for p in prompts):
        notes.append("multi-turn records: " + ("every turn run, each after the model's own answer" if a.all_turns
                                                else "first turn only (--all-turns runs them all)"))
    records = run(llm, prompts, runs, a.max_tokens, temperature=a.temperature, seed=a.seed, peer=peer,
                  all_turns=a.all_turns, progress=not a.no_progress, ignore_eos=a.ignore_eos)
    summary = report.summarize(records)
    bad = report.mismatch_count(summary) if greedy else 0
    if bad:
        wrong = sorted({(r["config"], r["question_id"]) for r in records
                        if r["engine"] == "specdec" and r["identical_to_plain"] is False})
        notes.append(f"[bold red]ERROR: {bad} greedy output(s) differ from plain decoding[/] (a bug in the "
                     "engine, please report it): " + escape(", ".join(f"{c} on {q}" for c, q in wrong[:10])))
    if peer is not None and greedy:
        notes.append(peer_agreement(records, a.peer))
    args = {k: v for k, v in vars(a).items() if k != "func"}
    path = report.write_results(a.output, records, summary, command_line(a), args=args,
                                configs=[c._asdict() for c in runs], prompts=len(prompts),
                                identity_check=("skipped (temperature > 0)" if not greedy
                                                else "FAILED" if bad else "passed"),
                                mismatches=bad, notes=[n.replace("[bold red]", "").replace("[/]", "")
                                                        for n in notes])
    report.print_tables(summary, notes, console)
    console.print("\nmarkdown (Spec-Bench layout):\n" + report.markdown(summary), markup=False, highlight=False)
    if a.plots:
        for p in report.plots(summary, a.plots):
            console.print(f"wrote {p}", highlight=False)
    console.print(f"wrote {path}", highlight=False)
    return 1 if bad else 0
