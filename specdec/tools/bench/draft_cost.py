"""What a drafted token costs against a target step, measured in one process: one-token forwards of the
draft (its head cut as the engine cuts it) and of each target alternate, so a drift of the host's speed
moves them alike. Prints each model's median ms per forward (T=1, context 256) and the ratios.

    python -m specdec.tools.bench.draft_cost --draft qwen2.5-coder-0.5b:int4:32768 \
        --targets qwen2.5-coder-1.5b:int4 qwen2.5-coder-1.5b:bf16 --repeats 15

A model is NAME:FORMAT[:HEAD] (FORMAT bf16/int4/int8/gguf; HEAD: the draft_vocab_size the head is cut
to, the 0.5B draft's default 32768; 0 or absent: the full head).
"""
import argparse
import statistics

from specdec.tools.bench.step import cut_head, load, time_forward


def build(spec: str):
    name, fmt, *rest = spec.split(":")
    model = load(name, None if fmt == "bf16" else fmt, True)
    head = int(rest[0]) if rest else 0
    if head:
        cut_head(model, name, head)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--targets", nargs="+", required=True)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=256)
    a = ap.parse_args(argv)
    specs = [a.draft, *a.targets]
    models = {s: build(s) for s in specs}
    ready: dict = {}
    times: dict[str, list[float]] = {s: [] for s in specs}
    for _ in range(a.repeats):
        for s, m in models.items():
            for _ in range(3):
                time_forward(m, 1, a.context, ready)
            times[s].append(min(time_forward(m, 1, a.context, ready) for _ in range(5)))
    med = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    for s in specs:
        print(f"{s}: {med[s]:.2f} ms per one-token forward (median of {a.repeats} rounds, each the best of 5)")
    for t in a.targets:
        per_round = statistics.median(d / x for d, x in zip(times[a.draft], times[t]))
        print(f"drafted token / {t} step: {med[a.draft] / med[t]:.3f} (median of the rounds' ratios {per_round:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
