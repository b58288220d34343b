"""Tokens per verification step of tree drafts under a JSON schema (greedy, batch 1): the number the
grammar masking of tree drafts changes. Counts only, no timing: safe beside other work.

    python scripts/tree_grammar_acceptance.py [--model smollm2-135m] [--config JSON]

The default drafter is the target's own weights at int4 drafting an EAGLE-2 tree (top-2, depth 6,
8 nodes); ``grammar_draft`` is off so that only the drafter's own tokens are counted. Every output is
checked against plain constrained decoding."""
from __future__ import annotations

import argparse
import json

from specdec import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"]}
INT4_TREE = {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0, "search_steps": 0,
             "draft_confidence_threshold": 0.0, "tree_topk": 2, "tree_depth": 6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--config", default=json.dumps(INT4_TREE), help="speculative_config as JSON")
    ap.add_argument("--prompts", type=int, default=6)
    a = ap.parse_args()
    cfg = json.loads(a.config) | {"num_speculative_tokens": 8, "grammar_draft": False}
    prompts = [f"Invent a person #{i} and describe them as JSON with name, age, city and hobbies."
               for i in range(a.prompts)]
    p = SamplingParams(temperature=0.0, max_tokens=96, structured_output={"json": json.dumps(SCHEMA)})
    ref = LLM(model=a.model, progress=False).generate(prompts, p)
    outs = LLM(model=a.model, progress=False, speculative_config=cfg).generate(prompts, p)
    same = all(o.outputs[0].token_ids == r.outputs[0].token_ids for o, r in zip(outs, ref))
    steps = sum(o.metrics.num_steps for o in outs)
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{toks} tokens in {steps} steps: {toks / steps:.2f} tokens/step; identical to plain: {same}")


if __name__ == "__main__":
    main()
