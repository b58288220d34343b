"""Logits -> probabilities: the one transform every path samples through.

``logits_to_probs`` is the one transform used by plain decoding, by every draft and by
verification, so that the distribution a draft is scored against is exactly the distribution the
target would have sampled from. The order follows vLLM and Hugging Face: temperature, then top-k
(Fan et al. 2018, "Hierarchical Neural Story Generation"), top-p (Holtzman et al. 2020, "The
Curious Case of Neural Text Degeneration"), min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p
Sampling for Creative and Coherent LLM Outputs"), then softmax over the surviving tokens.

Penalties and logit bias (``sampling/penalties.py``) come before all of this: the callers (the
verification step, the drafting loop) hand ``logits_to_probs`` the penalized logits, the same tensor
a greedy row takes its argmax from, so one processed distribution serves drafts, verification and
plain decoding alike.

Every filter is a threshold on the (temperature-scaled) logit, so the kept set depends only on the
values, never on the order of tied tokens: tokens tied with the last kept token are all kept
(top-k keeps every token whose logit >= the k-th largest, as ``torch.topk``-based filters in HF and
vLLM do; top-p likewise keeps the whole tie group at its boundary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specdec.config import SamplingParams


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors, plus Python flags that let the common case skip work.

    Greedy rows (temperature 0) carry their filters switched off: they become a one-hot anyway.
    ``top_k`` is 0 where off, ``top_p`` 1.0 where off, ``min_p`` 0.0 where off.
    """

    temperature: Tensor  # (B,) float32, 0.0 on greedy rows
    top_k: Tensor  # (B,) long, 0 = off
    top_p: Tensor  # (B,) float64, 1.0 = off
    min_p: Tensor  # (B,) float32, 0.0 = off
    greedy: Tensor  # (B,) bool
    do_top_k: bool  # some non-greedy row has top-k
    do_top_p: bool  # some non-greedy row has top-p
    do_min_p: bool  # some non-greedy row has min-p
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # largest active top_k (0 when none)
    top_p_without_top_k: bool  # some row's nucleus is searched over the whole vocabulary

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> "SamplingTensors":
        greedy = [p.temperature == 0.0 for p in params]
        top_k = [0 if g or p.top_k <= 0 else int(p.top_k) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor([float(p.temperature) for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float64, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            do_top_k=any(k > 0 for k in top_k),
            do_top_p=any(p < 1.0 for p in top_p),
            do_min_p=any(p > 0.0 for p in min_p),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            max_top_k=max(top_k, default=0),
            top_p_without_top_k=any(p < 1.0 and k == 0 for p, k in zip(top_p, top_k)),
        )

    def __len__(self) -> int:
        return self.temperature.shape[0]


def logits_to_probs(logits: Tensor, st: SamplingTensors, top_p_window: int = 1024) -> Tensor:
    """Temperature, top-k, top-p, min-p, softmax: logits (B, V) or (B, T, V) -> float32 probs.

    Row b of ``st`` applies to every position of row b. Greedy rows give a one-hot at
    ``torch.argmax`` (ties: lowest index). top-k keeps logits >= the k-th largest (all of them when
    k >= V); top-p keeps the smallest prefix of the descending order whose mass (after top-k) is
    >= top_p, widened to its whole tie group; min-p keeps tokens with p >= min_p * p_max. The result
    is deterministic, and a row's result does not depend on the other rows of the batch.
    Only top-k / top-p sort, and only the largest ``top_p_window`` (or max top_k) logits; a row
    whose nucleus is wider retries alone with a 16x wider window, up to a full sort. The kept set
    is exact up to float rounding of the masses (float64 cumsum of float32 probabilities).
    """
    if logits.dim() == 3:
        B, T, V = logits.shape
        return _probs_2d(logits.reshape(B * T, V), st, T, top_p_window).view(B, T, V)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V) or (B, T, V), got {tuple(logits.shape)}")
    return _probs_2d(logits, st, 1, top_p_window)


def _rows(t: Tensor, repeat: int) -> Tensor:
    return t if repeat == 1 else t.repeat_interleave(repeat)


def _probs_2d(logits: Tensor, st: SamplingTensors, repeat: int, window: int) -> Tensor:
    N, V = logits.shape
    if N != len(st) * repeat:
        raise ValueError(f"{N // repeat} rows of logits for {len(st)} rows of sampling parameters")
    if st.all_greedy:
        return _one_hot(logits.argmax(-1), V)
    temp = _rows(st.temperature, repeat)  # (N,)
    if st.any_greedy:
        temp = torch.where(_rows(st.greedy, repeat), 1.0, temp)  # replaced by a one-hot below
    x = logits.to(torch.float32) / temp[:, None]  # (N, V), a fresh tensor: safe to edit in place
    if st.do_top_k or st.do_top_p or st.do_min_p:
        m = x.amax(-1)  # (N,) the top token survives every filter
        e = torch.exp(x - m[:, None]) if (st.do_top_p or st.do_min_p) else None  # (N, V) p / p_max
        if st.do_top_k or st.do_top_p:
            thresh = _threshold(x, m, e, _rows(st.top_k, repeat), _rows(st.top_p, repeat), st,
                                window)
            x.masked_fill_(x < thresh[:, None], float("-inf"))
        if st.do_min_p:
            x.masked_fill_(e < _rows(st.min_p, repeat)[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)  # (N, V)
    if st.any_greedy:
        greedy = _rows(st.greedy, repeat)  # (N,)
        idx = logits.argmax(-1, keepdim=True)  # (N, 1)
        keep = probs.gather(1, idx)  # (N, 1) non-greedy rows write their own value back
        probs.masked_fill_(greedy[:, None], 0.0)
        probs.scatter_(1, idx, torch.where(greedy[:, None], 1.0, keep))
    return probs


def _one_hot(ids: Tensor, V: int) -> Tensor:
    out = torch.zeros(ids.shape[0], V, dtype=torch.float32, device=ids.device)  # (N, V)
    return out.scatter_(1, ids[:, None], 1.0)


def _threshold(x: Tensor, m: Tensor, e: Tensor | None, k: Tensor, top_p: Tensor,
               st: SamplingTensors, window: int) -> Tensor:
    """(N,) logit threshold of top-k then top-p: keep x >= threshold. Sorts only what it needs."""
    N, V = x.shape
    W = min(V, max(st.max_top_k, window if st.top_p_without_top_k else 0))
    vals = _descending(x, W)  # (N, W)
    thresh = torch.full((N,), float("-inf"), device=x.device)  # (N,)
    k_on = k > 0
    if st.do_top_k:  # k <= max_top_k <= W, and k > V keeps everything
        kth = vals.gather(1, (k.clamp(1, W) - 1)[:, None])[:, 0]
        thresh = torch.where(k_on, kth, thresh)
    if not st.do_top_p:
        return thresh
    kept = torch.where(x >= thresh[:, None], e, 0.0) if st.do_top_k else e  # (N, V)
    z = kept.sum(-1).double()  # (N,) unnormalised mass of the top-k survivors
    cut, reached = _nucleus_cut(vals, thresh, m, z, top_p)
    # A row is settled when its cut lies in the window: the mass reached top_p, the window is the
    # whole vocabulary, or top-k is on (survivors past a top-k window tie with its last value).
    # Flat rows whose nucleus is wider than the window retry with a 16x wider one (topk is far
    # cheaper than a full sort on a large vocabulary).
    settled = reached | k_on | (top_p >= 1.0)  # (N,)
    while W < V and not bool(settled.all()):
        W = min(V, W * 16)
        rows = (~settled).nonzero()[:, 0]
        cut[rows], reached = _nucleus_cut(_descending(x[rows], W), thresh[rows], m[rows], z[rows],
                                          top_p[rows])
        settled[rows] = reached | (W == V)
    return torch.where(top_p < 1.0, torch.maximum(thresh, cut), thresh)


def _descending(x: Tensor, W: int) -> Tensor:
    if W >= x.shape[1]:
        return torch.sort(x, dim=-1, descending=True).values
    return torch.topk(x, W, dim=-1, sorted=True).values


def _nucleus_cut(vals: Tensor, thresh: Tensor, m: Tensor, z: Tensor,
                 top_p: Tensor) -> tuple[Tensor, Tensor]:
    """Smallest descending prefix with mass >= top_p: (its last logit (N,), mass reached (N,))."""
    surv = vals >= thresh[:, None]  # (N, W) top-k survivors: a prefix
    p = torch.where(surv, torch.exp(vals - m[:, None]).double(), 0.0) / z[:, None]  # (N, W)
    cum = p.cumsum(-1)  # (N, W) float64
    n = ((cum - p < top_p[:, None]) & surv).sum(-1).clamp(min=1)  # (N,) tokens before the cut
    cut = vals.gather(1, (n - 1)[:, None])[:, 0]
    return cut, cum[:, -1] >= top_p
