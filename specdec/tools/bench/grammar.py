"""Which grammar engine to use: compile time and per-token mask time of llguidance, xgrammar and
outlines-core on one model's tokenizer, walking the same JSON documents token by token.

    python -m specdec.tools.bench.grammar --model qwen2.5-coder-1.5b [--output results/grammar.json]

llguidance is specdec's engine (a dependency); xgrammar and outlines-core are measured when installed
(``pip install --no-deps xgrammar apache-tvm-ffi outlines-core``: xgrammar's declared triton
requirement is for GPUs). Each engine gets the tokenizer once, then per schema: the compile time
(first matcher ready) and, over the document's tokens, the mean time to compute the next-token
mask and consume the token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.errors import SpecdecError

SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "email": {"type": "string"}},
      "required": ["name", "age", "email"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    ({"type": "object", "properties": {
        "order_id": {"type": "string"}, "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                             "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
      "required": ["order_id", "items", "paid", "note"], "additionalProperties": False},
     {"order_id": "A-1042", "items": [{"sku": "pen-blue", "qty": 3, "price": 1.25},
                                      {"sku": "paper-a4", "qty": 1, "price": 6.5}], "paid": True, "note": None}),
    ({"type": "object", "properties": {"name": {"enum": ["get_weather", "search"]}, "arguments": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "unit", "days"], "additionalProperties": False}},
      "required": ["name", "arguments"], "additionalProperties": False},
     {"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius", "days": 3}}),
]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def measure(docs, start, step, engine: str) -> list[dict]:
    """Per document: the time ``start(schema)`` takes (compile, first mask) and the mean time of
    ``step(state, token)`` (mask, then consume) over its tokens."""
    rows = []
    for schema, ids in docs:
        t0 = time.perf_counter()
        state = start(schema)
        compile_s = time.perf_counter() - t0
        times = []
        for i in ids:
            t0 = time.perf_counter()
            ok = step(state, i)
            times.append(time.perf_counter() - t0)
            if not ok:
                raise SpecdecError(f"{engine} rejected token {i} of a valid document")
        rows.append({"compile_ms": _ms(compile_s), "token_ms": _ms(statistics.mean(times)), "tokens": len(ids)})
    return rows


def bench_llguidance(hf_tok, vocab: int, eos: list[int], docs) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    from specdec.sampling.grammar import JSON_OPTIONS

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos)
    out = {"engine": f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else ''}".strip(),
           "tokenizer_s": round(time.perf_counter() - t0, 3), "schemas": []}
    bm = lt.allocate_token_bitmask(1, vocab)

    def start(schema):
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
                                 log_level=0)
        lt.fill_next_token_bitmask(m, bm)  # the first mask: compilation is lazy
        return m

    def step(m, i: int) -> bool:
        lt.fill_next_token_bitmask(m, bm)
        return m.consume_token(i)

    out["schemas"] = measure(docs, start, step, "llguidance")
    return out


def bench_xgrammar(hf_tok, vocab: int, eos: list[int], docs) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out = {"engine": f"xgrammar {getattr(xgr, '__version__', '')}".strip(),
           "tokenizer_s": round(time.perf_counter() - t0, 3), "schemas": []}
    bm = xgr.allocate_token_bitmask(1, vocab)

    def start(schema):
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        m = xgr.GrammarMatcher(cg)
        m.fill_next_token_bitmask(bm)
        return m

    def step(m, i: int) -> bool:
        m.fill_next_token_bitmask(bm)
        return m.accept_token(i)

    out["schemas"] = measure(docs, start, step, "xgrammar")
    return out


def bench_outlines(hf_tok, vocab: int, eos: list[int], docs) -> dict:
    import outlines_core
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    # from the tokenizer's own vocabulary (``from_pretrained`` would fetch from the hub); byte-level
    # BPE strings are mapped back to their bytes
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    table: dict[bytes, list[int]] = {}
    for text, i in hf_tok.get_vocab().items():
        if i in eos or i >= vocab or i in hf_tok.all_special_ids:
            continue
        try:
            table.setdefault(bytes(back[c] for c in text), []).append(i)
        except KeyError:  # an added token outside the byte alphabet
            table.setdefault(text.encode(), []).append(i)
    voc = Vocabulary(eos[0], table)
    out = {"engine": f"outlines-core {getattr(outlines_core, '__version__', '')}".strip(),
           "tokenizer_s": round(time.perf_counter() - t0, 3), "schemas": []}

    def start(schema):
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?"), voc))
        guide.get_tokens()
        return guide

    def step(guide, i: int) -> bool:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[torch.tensor(guide.get_tokens())] = True  # what a sampler needs: a dense mask
        guide.advance(i)
        return True

    out["schemas"] = measure(docs, start, step, "outlines-core")
    return out


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="embedded model name or model directory (its tokenizer is used)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    from specdec.formats.hf import load_model_config
    from specdec.formats.loader import resolve_model
    from specdec.formats.tokenizer import Tokenizer

    try:
        path = resolve_model(args.model)
        tok = Tokenizer(path)
        vocab = load_model_config(path).vocab_size
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eos = sorted(tok.eos_token_ids)
    docs = [(s, tok.encode(json.dumps(d), add_special_tokens=False)) for s, d in SCHEMAS]
    results = []
    for name in args.engines:
        try:
            r = ENGINES[name](tok.hf, vocab, eos, docs)
        except ImportError as e:
            print(f"{name}: not installed ({e}); skipped", file=sys.stderr)
            continue
        except Exception as e:  # noqa: BLE001 (one engine failing does not stop the others)
            print(f"{name}: failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        r["mean_compile_ms"] = round(statistics.mean(s["compile_ms"] for s in r["schemas"]), 3)
        r["mean_token_ms"] = round(statistics.mean(s["token_ms"] for s in r["schemas"]), 4)
        results.append(r)
        print(f"{r['engine']:<22} tokenizer {r['tokenizer_s']:6.2f} s  compile {r['mean_compile_ms']:8.2f} ms  "
              f"mask+consume {r['mean_token_ms']:7.3f} ms/token")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"model": args.model, "torch_threads": torch.get_num_threads(),
                                                 "results": results}, indent=2))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
