"""`specdec serve` whose engine emits canned replies: tool calling on a tiny random model.

``SPECDEC_FORCED`` is a JSON list of ``[marker, reply]``: a request whose prompt (decoded with its
special tokens) contains ``marker`` gets ``reply`` then EOS, one token per step, whatever the model
would have said (the first matching marker wins; other requests are untouched). Everything else is
the real server: chat template, tokenizer, scheduler, streaming, tool-call parsing.

    python -m forced_serve serve --model DIR ...   (tests/server on PYTHONPATH)
"""
from __future__ import annotations

import json
import os
import sys

import specdec.engine.core as core
from specdec.cli import main
from specdec.engine.step import StepOutput, speculative_step
from specdec.formats.tokenizer import Tokenizer


def install(model_dir: str, forced: list[list[str]]) -> None:
    tok = Tokenizer(model_dir)
    eos = sorted(tok.eos_token_ids)[0]
    replies: dict[str, list[int] | None] = {}

    def reply_for(seq) -> list[int] | None:
        if seq.request_id not in replies:
            prompt = tok.decode(seq.prompt_ids, skip_special_tokens=False)
            text = next((r for m, r in forced if m in prompt), None)
            replies[seq.request_id] = None if text is None else tok.encode(text, add_special_tokens=False) + [eos]
        return replies[seq.request_id]

    def forced_step(runner, proposer, seqs, ks, *rest) -> StepOutput:
        out = speculative_step(runner, proposer, seqs, ks, *rest)
        for i, s in enumerate(seqs):
            ids = reply_for(s)
            if ids is not None:  # one canned token, no draft kept (the proposer's bookkeeping stays true)
                out.emitted[i] = [ids[min(len(s.output_ids), len(ids) - 1)]]
                out.num_accepted[i] = 0
                if out.logprobs is not None:
                    out.logprobs[i] = None
        return out

    core.speculative_step = forced_step


if __name__ == "__main__":
    install(sys.argv[sys.argv.index("--model") + 1], json.loads(os.environ["SPECDEC_FORCED"]))
    sys.exit(main(sys.argv[1:]))
