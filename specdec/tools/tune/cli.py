"""`specdec tune`: the deployment checklist, run on the user's own prompts within a time budget.

    specdec tune --model qwen2.5-coder-1.5b --prompts my_prompts.jsonl --budget 20 --output tuned/

1. baseline: plain decoding one request at a time (time to first token, time per token), the
   target's weights and KV cache per token;
2. candidates (``candidates.py``): each drafter at K=5 on the same prompts: tokens/s, speedup,
   acceptance, tokens per target step, drafting cost, memory it adds; a drafter that cannot load
   (another tokenizer, a missing head) is skipped with the reason;
3. tuning: K (2, 3, 8 besides 5) for the two best, then the confidence cut-off of the best where it
   has one, and, where it has one and the prompts are long, how much of the prompt the draft reads
   (``draft_context``: the last 512, 1,024 or 2,048 tokens, each below the longest prompt; a draft
   reading the whole of a long prompt pays its prefill and attention over all of it);
4. batch sizes 1, 2, 4, ... ``--max-batch``: plain against the winner, tokens/s over the batch, so
   the batch size where speculation stops paying is measured (the rule of thumb is used only for
   sizes the budget left unmeasured);
5. decision (``decide.py``) written as ``specdec-config.json`` (``LLM(config=...)``, ``specdec
   generate/serve --config``), ``report.md`` with PNG plots, and ``results.json`` with every figure.

Every configuration runs greedy on the same prompts (its outputs are checked identical to plain
decoding's: a mismatch is an engine bug and fails the command). Phases stop when the budget runs out;
what was not measured is said in the report.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.errors import SpecdecError

KS = (2, 3, 8)  # swept besides the default 5
DEFAULT_K = 5
THRESHOLDS = (0.4,)  # confidence cut-offs tried for the winner (0: none, its default)
CONTEXTS = (512, 1024, 2048)  # draft_context windows tried for the winner, those below the longest prompt
MIN_BUDGET_MINUTES = 1.0


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    from specdec.args import add_model_args  # noqa: PLC0415

    t = sub.add_parser("tune", help="pick and tune a drafter for your prompts; writes a config and a report",
                       description=(__doc__ or "").split("\n\n")[0])
    add_model_args(t)
    t.add_argument("--prompts", required=True,
                   help="JSONL prompts, one per line: {\"turns\": [...]} (chat) or {\"prompt\": ...} (required)")
    t.add_argument("--output", required=True, help="directory for specdec-config.json, report.md, plots (required)")
    t.add_argument("--candidates", nargs="+", default=None, metavar="NAME",
                   help="drafters to try: ngram, suffix, self-int4, cascade-self, draft:MODEL[:int4|int8|bf16], "
                        "eagle:DIR (default: the free and self drafters plus smaller local models)")
    t.add_argument("--max-batch", type=int, default=4, help="largest batch size measured (default 4)")
    t.add_argument("--budget", type=float, default=20.0, help="minutes the whole run may take (default 20)")
    t.add_argument("--num-prompts", type=int, default=4,
                   help="prompts measured per configuration, from the file's start (default 4)")
    t.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_tune)


def cmd_tune(a: argparse.Namespace) -> int:
    from specdec.tools.tune import candidates as cands  # noqa: PLC0415
    from specdec.tools.tune.measure import Budget  # noqa: PLC0415

    budget = Budget(a.budget * 60)
    if a.budget < MIN_BUDGET_MINUTES:
        raise SpecdecError(f"--budget {a.budget:g} minutes is too small: give at least {MIN_BUDGET_MINUTES:g}")
    for flag, v in (("--max-batch", a.max_batch), ("--num-prompts", a.num_prompts), ("--max-tokens", a.max_tokens)):
        if v < 1:
            raise SpecdecError(f"{flag} must be at least 1, got {v}")
    chosen = [cands.parse(n) for n in a.candidates] if a.candidates else None
    prompts = read_prompts(a.prompts, a.num_prompts)
    out = Path(a.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot create directory '{out}': {e.strerror}") from e
    from specdec.llm import LLM  # noqa: PLC0415

    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              quantization=a.quantization, progress=not a.no_progress, max_num_seqs=max(a.max_batch, 1))
    if chosen is None:
        chosen = cands.discover(a.model, llm.target.path, llm.target.quantization is not None)
    ids = [prompt_ids(llm, p) for p in prompts]
    tuner = Tuner(llm, ids, a.max_tokens, budget, progress=not a.no_progress)
    result = tuner.run(chosen, a.max_batch)
    from specdec.tools.tune.report import write  # noqa: PLC0415
    paths = write(out, a, llm, result)
    print("\n".join(result["decision"].reasons))
    for p in paths:
        print(f"wrote {p}")
    if result["mismatches"]:
        print(f"error: {len(result['mismatches'])} configuration(s) gave greedy outputs that differ from plain "
              f"decoding (an engine bug, please report it): {', '.join(result['mismatches'])}", file=sys.stderr)
        return 1
    return 0


def read_prompts(path: str, limit: int) -> list:
    from specdec.tools.bench.prompts import load_prompts  # noqa: PLC0415

    prompts = load_prompts(path, None, None)
    if not prompts:
        raise SpecdecError(f"prompt file '{path}' holds no prompts")
    return prompts[:limit]


def prompt_ids(llm, prompt) -> list[int]:
    """A benchmark prompt's token ids: the first chat turn templated, or the raw completion text."""
    if prompt.is_chat:
        return llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt.turns[0]}])
    return llm.tokenizer.encode(prompt.prompt)


class Tuner:
    """Runs the phases on one loaded target, each while the budget allows."""

    def __init__(self, llm, prompts: list[list[int]], max_tokens: int, budget, progress: bool = True) -> None:
        from specdec.config import SamplingParams  # noqa: PLC0415

        self.llm, self.prompts, self.budget, self.progress = llm, prompts, budget, progress
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.warm = self.params.replace(max_tokens=4)
        self.results: list = []
        self.skipped: list[str] = []
        self.mismatches: list[str] = []
        self.plain_ids: dict[int, list[list[int]]] = {}
        self.unit = 0.0  # seconds plain decoding of the prompts took: the budget's yardstick
        self.plain_wall = self.plain_tps = 0.0
        self._memory: dict[str, int] = {}  # candidate -> resident bytes its loading added

    def run(self, candidates: list, max_batch: int) -> dict:
        from rich.console import Console  # noqa: PLC0415
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

        from specdec.tools.tune.decide import decide, ranked  # noqa: PLC0415
        from specdec.tools.tune.measure import kv_bytes_per_token, latency, model_bytes  # noqa: PLC0415

        llm = self.llm
        cols = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                TimeElapsedColumn())
        with Progress(*cols, console=Console(stderr=True), disable=not self.progress) as bar:
            self.bar = bar
            self.task = bar.add_task("tune: plain decoding", total=self.budget.seconds)
            self._tick("plain decoding (baseline)")
            llm.set_speculative_config(None)
            llm.generate(self.prompts[0], self.warm, num_speculative_tokens=0)
            base = latency(llm, self.prompts, self.params)
            plain = self._measure("plain", None, 0)
            self.unit = max(self.plain_wall, 1e-3)
            base |= {"tokens_per_second": plain.tokens_per_second,
                     "weights_bytes": model_bytes(llm.target.model),
                     "kv_bytes_per_token": kv_bytes_per_token(llm.target.config, llm.target.model.embed_tokens.weight
                                                              .element_size())}
            if self.budget.left() < self.unit:
                raise SpecdecError(f"--budget is too small: plain decoding of the prompts alone took {self.unit:.0f} s "
                                   f"and {max(self.budget.left(), 0):.0f} s are left; give more minutes, fewer "
                                   "--num-prompts or a smaller --max-tokens")
            per_token = base["seconds_per_token"] or 1 / max(plain.tokens_per_second, 1e-9)
            # 2. every candidate at the default K (a quarter of the budget kept for tuning and batches)
            for c in candidates:
                if self.budget.left() < 0.25 * self.budget.seconds + self.unit:
                    self.skipped.append(f"{c.name}: not measured (budget)")
                    continue
                self._candidate(c.name, c.spec, DEFAULT_K, per_token, load=True)
            best = ranked(self.results)
            # 3. K for the two best, then the winner's confidence cut-off
            for r in best[:2]:
                for k in KS:
                    if self._room(1.0):
                        self._candidate(r.name, r.spec, k, per_token)
                    else:
                        self.skipped.append(f"{r.name} K={k}: not measured (budget)")
            best = ranked(self.results)
            if best and "draft_confidence_threshold" in _fields(best[0].spec):
                for th in THRESHOLDS:
                    if self._room(1.0):
                        spec = dict(best[0].spec, draft_confidence_threshold=th)
                        self._candidate(best[0].name, spec, best[0].k, per_token)
            best = ranked(self.results)
            if best and "draft_context" in _fields(best[0].spec):
                longest = max(len(p) for p in self.prompts)
                for n in (n for n in CONTEXTS if n < longest):
                    if self._room(1.0):
                        self._candidate(best[0].name, dict(best[0].spec, draft_context=n), best[0].k, per_token)
                    else:
                        self.skipped.append(f"{best[0].name} draft context {n}: not measured (budget)")
            # 4. batch sizes: plain against the winner
            best = ranked(self.results)
            plain_b: dict[int, float] = {}
            spec_b: dict[int, float] = {}
            if best and best[0].speedup > 1.0:
                win = best[0]
                sizes = [1] + [b for b in (2, 4, 8, 16, 32, 64) if b <= max_batch]
                plain_b[1], spec_b[1] = plain.tokens_per_second, win.tokens_per_second
                for b in sizes[1:]:
                    if not self._room(2.0 * b / len(self.prompts)):
                        self.skipped.append(f"batch {b}: not measured (budget)")
                        continue
                    llm.set_speculative_config(None)
                    plain_b[b] = self._measure("plain", None, 0, batch=b).tokens_per_second
                    llm.set_speculative_config(dict(win.spec, num_speculative_tokens=win.k))
                    spec_b[b] = self._measure(win.name, win.spec, win.k, batch=b).tokens_per_second
            decision = decide(self.results, plain_b, spec_b, max_batch)
            self._tick("done")
        llm.set_speculative_config(None)
        return {"baseline": base, "plain": plain, "results": self.results, "plain_by_batch": plain_b,
                "spec_by_batch": spec_b, "decision": decision, "skipped": self.skipped,
                "mismatches": self.mismatches, "seconds": self.budget.spent()}

    # ---- one measurement --------------------------------------------------------------------
    def _candidate(self, name: str, spec: dict, k: int, per_token: float, load: bool = False) -> None:
        """``spec`` with draft length ``k`` measured against plain (``load``: the candidate's first
        config, whose loading's memory is counted)."""
        from specdec.tools.tune.measure import rss_bytes  # noqa: PLC0415

        label = describe(name, spec, k)
        self._tick(label)
        before = rss_bytes()
        try:
            self.llm.set_speculative_config(dict(spec, num_speculative_tokens=k))
            self.llm.generate(self.prompts[0], self.warm, num_speculative_tokens=k)
        except SpecdecError as e:
            self.skipped.append(f"{name}: skipped: {e}")
            return
        m = self._measure(name, spec, k)
        m.draft_cost = m.draft_cost / per_token
        m.memory_bytes = max(rss_bytes() - before, 0) if load else self._memory.get(name, 0)
        self._memory[name] = m.memory_bytes

    def _measure(self, name: str, spec: dict | None, k: int, batch: int = 1):
        from specdec.tools.tune.measure import run  # noqa: PLC0415

        m, wall, ids = run(self.llm, self.prompts, self.params, name, spec, k, batch)
        if spec is None and batch == 1:
            self.plain_wall, self.plain_tps = wall, m.tokens_per_second
        m.speedup = m.tokens_per_second / self.plain_tps if self.plain_tps else 1.0
        if spec is None:  # greedy outputs must equal plain decoding's, batch for batch
            self.plain_ids[batch] = ids
        elif batch in self.plain_ids and ids != self.plain_ids[batch]:
            self.mismatches.append(f"{name} K={k} batch {batch}")
        self.results.append(m)
        self.bar.update(self.task, completed=min(self.budget.spent(), self.budget.seconds))
        return m

    def _room(self, units: float) -> bool:
        return self.budget.left() > units * self.unit

    def _tick(self, what: str) -> None:
        self.bar.update(self.task, description=f"tune: {what}", completed=min(self.budget.spent(), self.budget.seconds))


def describe(name: str, spec: dict, k: int) -> str:
    """A configuration's name for the progress line and the report: the candidate, K, and what was tuned."""
    cut, window = spec.get("draft_confidence_threshold"), spec.get("draft_context")
    return f"{name} K={k}" + (f" cut-off {cut}" if cut else "") + (f" draft context {window}" if window else "")


def _fields(spec: dict | None) -> set[str]:
    from specdec.proposers.registry import config_method, schema  # noqa: PLC0415

    return {f.name for f in schema(config_method(spec or {})).fields()} if spec else set()


def main(argv: list[str] | None = None) -> int:  # python -m specdec.tools.tune.cli
    p = argparse.ArgumentParser(prog="specdec")
    add_tune_parser(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(["tune", *(argv if argv is not None else sys.argv[1:])])
    try:
        return a.func(a)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
