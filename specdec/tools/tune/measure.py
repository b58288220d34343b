"""Measuring configurations on the user's prompts for `specdec tune`, within a time budget."""
from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.config import SamplingParams
from specdec.tools.tune.decide import Measured


@dataclass
class Budget:
    """Wall-clock seconds the whole command may take, counted from its start."""

    seconds: float
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = self.start or time.perf_counter()

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.spent()


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def model_bytes(model) -> int:
    """Bytes of a model's weights as held (parameters, buffers, packed and quantized copies)."""
    total = 0
    for m in model.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            total += t.numel() * t.element_size()
        for name in ("packed", "tiled"):
            relaid = getattr(m, name, None)
            if relaid is not None:
                total += relaid.numel() * relaid.element_size()
        q = getattr(m, "qweight", None)
        if q is not None:
            total += q.nbytes
    return total


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


def run(llm, prompts: list[list[int]], params: SamplingParams, name: str, spec: dict | None, k: int,
        batch: int = 1) -> tuple[Measured, float, list[list[int]]]:
    """``spec`` (None: plain) with draft length ``k`` over ``prompts``: one at a time (``batch`` 1) or
    ``batch`` at once (the prompts cycled to fill it). Returns the measurement, the wall seconds it
    took and the generated token ids; ``speedup`` (against plain) and ``draft_cost`` (set here to the drafting seconds per drafted
    token) are the caller's to relate to plain decoding. The config must be set already."""
    from specdec.metrics import aggregate  # noqa: PLC0415

    kk = k if spec is not None else 0
    t0 = time.perf_counter()
    if batch == 1:
        outs = [llm.generate(p, params, num_speculative_tokens=kk)[0] for p in prompts]
    else:
        fill = [prompts[i % len(prompts)] for i in range(batch)]
        outs = llm.generate(fill, params, num_speculative_tokens=kk)
    wall = time.perf_counter() - t0
    m = aggregate(outs)
    tokens = m.num_generated_tokens
    draft_per_token = m.draft_seconds / m.num_draft_tokens if m.num_draft_tokens else 0.0
    return Measured(name=name, spec=spec, k=kk, tokens_per_second=tokens / wall if wall > 0 else 0.0,
                    acceptance=m.acceptance_rate, tokens_per_step=m.mean_accepted_length if spec is not None else 1.0,
                    mean_tokens=tokens / len(outs), batch=batch, acceptance_by_position=list(m.acceptance_by_position),
                    draft_cost=draft_per_token), wall, [o.outputs[0].token_ids for o in outs]


def latency(llm, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Plain decoding one request at a time: time to first token and time per output token."""
    outs = [llm.generate(p, params, num_speculative_tokens=0)[0].metrics for p in prompts]
    n = len(outs)
    per_token = [m.decode_seconds / (m.num_generated_tokens - 1) for m in outs if m.num_generated_tokens > 1]
    return {"ttft_seconds": sum(m.prefill_seconds for m in outs) / n,
            "seconds_per_token": sum(per_token) / len(per_token) if per_token else 0.0,
            "prompt_tokens": sum(m.num_prompt_tokens for m in outs) / n}
