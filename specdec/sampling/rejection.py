"""Verification of a draft chain: greedy matching and lossless speculative sampling.

Speculative sampling (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"). A proposer drafts tokens x_0 .. x_{n-1} (n = ``num_draft[b]`` <= K), x_i
drawn from the draft distribution q_i; one target forward pass scores all of them, giving the
target distributions p_0 .. p_n (p_i conditions on the prompt and x_0 .. x_{i-1}). Terms, as vLLM
uses them:

* *accepted* tokens: the draft prefix that is kept. x_i is accepted with probability
  min(1, p_i(x_i) / q_i(x_i)), scanning left to right until the first rejection.
* the *recovered* token: at the first rejected position i, a token sampled from the residual
  norm(max(0, p_i - q_i)) in place of x_i.
* the *bonus* token: when all n draft tokens are accepted, a token sampled from p_n, which the
  target pass computed anyway.

Each row therefore emits ``num_accepted + 1`` tokens, and every emitted token has exactly the law
the target alone would have sampled it with. Outputs are ``out_ids (B, K+1)`` holding the emitted
tokens in ``out_ids[b, :num_accepted[b] + 1]`` and -1 after them, and ``num_accepted (B,)``.

Conventions chosen here:

* ``draft_probs=None`` means the draft is deterministic (n-gram lookup, greedy draft model): q_i is
  the one-hot at x_i, so x_i is accepted with probability p_i(x_i) and the recovered token is drawn
  from p_i with x_i zeroed, renormalised. This rule is lossless for *any* x_i that does not depend
  on the verifier's own randomness.
* q_i(x_i) == 0 (the draft could not have sampled x_i: a padded, truncated or re-filtered draft) is
  treated as a deterministic proposal at that position, with the rule above. Accepting it outright
  (ratio = inf) would bias the output toward x_i; the one-hot rule keeps that position lossless.
  (A draft whose tokens were not sampled from the q it reports, with q(x) > 0, cannot be detected.)
* p == q: the ratio is exactly 1 and u < 1, so the token is always accepted. Disjoint supports:
  p(x) = 0, always rejected, and the residual is p itself.
* If the residual is exactly zero at a rejection (p == q numerically, up to rounding that made p(x)
  a hair below q(x)) the recovered token is drawn from p. A tiny positive residual is used as is;
  either way the error is bounded by the probability of that rejection, which is the residual mass.
* Greedy rows need no special case: a one-hot p accepts x iff x is its argmax, the residual is the
  one-hot at that argmax, and sampling a one-hot returns its index, which is exactly
  ``verify_greedy``.
* Randomness is keyed (``sampling.rng``), never a stream: the acceptance test of node i uses the
  uniform of key (seed, its token's position, ACCEPT, i) and the recovered / bonus token is the
  Gumbel-max sample (``RowKeys.gumbel_argmax``: argmax(w / E), exact for any weights w) with the noise
  of its own position. A row's draws therefore do not depend on the batch, on the other rows' draft
  lengths, or on which step reaches a position; and a step without drafts samples exactly as plain
  decoding does (the same Gumbel-max draw), so the target's own tokens match plain decoding's
  wherever no draft intervened. The tokens still depend on the drafts (a different K, a different
  draft: other tokens of the same law); ``sampling.gumbel`` verifies so that they do not.

Trees. A tree draft adds ``parents (B, K)``: node i's parent (-1 for children of the pending
token), with p_i / q_i the target / draft distributions at node i's parent's position (target
position 1 + parent: the block is [pending, node 0, ..]). The chain is ``parents[b, i] = i - 1``.
Tree verification walks down from the root: the children of the current node are tried in index
order, child c accepted with probability min(1, p(c) / q_c(c)); after each rejected sibling, p is
replaced by the normalised residual norm(max(0, p - q_c)) before the next sibling is tried
(multi-draft recursive rejection sampling: Miao et al. 2024, "SpecInfer"; Chen et al. 2024,
"Sequoia"; Jeon et al. 2024, "Recursive Speculative Decoding"), and when every child is rejected
the recovered token is sampled from the current residual; an accepted leaf is followed by the bonus
token sampled from p at that leaf. ``q_c`` is the distribution sibling c was drawn from *given the
siblings before it* (i.i.d. siblings: the same q each time; siblings drawn without replacement: q
with the earlier ones removed), or the one-hot at c for a deterministic tree (top-k children,
suffix matches): then a rejected sibling is simply removed from p. Greedy rows: the longest path
whose every token is the target's argmax (the first such path in node order on ties). With one
child per node both are exactly the chain rules above (``verify_tree_*`` on ``parents = i - 1``
give ``verify_*``'s results; tests/sampling/test_rejection.py). Outputs add ``path (B, K)``: the
accepted nodes in order, -1 after them.

Why not Traversal Verification (Weng et al. 2025, arXiv 2505.12398). Any lossless verifier accepts
node n only when the target's own sample begins with n's path, so its expected accepted length is
at most the sum over nodes of P_target(path to n). On a deterministic tree (every tree drafter here:
top-k children, Medusa ranks, suffix matches) the rule above reaches that bound: a rejected one-hot
sibling is removed from p, so the walk accepts exactly the child the target would have sampled
(tests/sampling/test_rejection_tree.py checks the bound). Sequence-level acceptance gains only on
trees *sampled* from q, which no proposer here drafts.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.sampling.rng import ACCEPT, RowKeys


def _check(draft_ids: Tensor, target: Tensor, num_draft: Tensor) -> tuple[int, int]:
    B, K = draft_ids.shape
    if target.dim() != 3 or target.shape[:2] != (B, K + 1):
        raise ValueError(f"target must be (B, K+1, V) = ({B}, {K + 1}, V) for draft_ids "
                         f"{tuple(draft_ids.shape)}, got {tuple(target.shape)}")
    if num_draft.shape != (B,):
        raise ValueError(f"num_draft must be ({B},), got {tuple(num_draft.shape)}")
    return B, K


def _check_sampled(draft_ids: Tensor, draft_probs: Tensor | None, target_probs: Tensor, num_draft: Tensor,
                   keys: RowKeys) -> tuple[int, int, int]:
    B, K = _check(draft_ids, target_probs, num_draft)
    V = target_probs.shape[-1]
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs must be ({B}, {K}, {V}), got {tuple(draft_probs.shape)}")
    if len(keys) != B:
        raise ValueError(f"{len(keys)} rows of random keys for {B} rows")
    return B, K, V


def _prefix_length(accept: Tensor) -> Tensor:
    """(B, K) bool -> (B,) long: length of the leading run of True."""
    return accept.long().cumprod(-1).sum(-1)


def verify_greedy(draft_ids: Tensor, target_logits: Tensor,
                  num_draft: Tensor) -> tuple[Tensor, Tensor]:
    """Accept the longest draft prefix equal to the target's argmax, then emit the target's argmax.

    draft_ids (B, K) long, target_logits (B, K+1, V), num_draft (B,) long (positions >=
    num_draft[b] are padding, never accepted) -> (out_ids (B, K+1) long, num_accepted (B,) long).
    The emitted token after the accepted prefix is the target argmax there: recovered on a
    mismatch, bonus after a fully accepted draft. Ties in the argmax: lowest index.
    """
    B, K = _check(draft_ids, target_logits, num_draft)
    target_ids = target_logits.argmax(-1)  # (B, K+1)
    pos = torch.arange(K + 1, device=draft_ids.device)  # (K+1,)
    valid = pos[None, :K] < num_draft[:, None]  # (B, K)
    num_accepted = _prefix_length((draft_ids == target_ids[:, :K]) & valid)  # (B,)
    out_ids = torch.where(pos[None, :] <= num_accepted[:, None], target_ids, -1)  # (B, K+1)
    return out_ids, num_accepted


def verify_sampled(draft_ids: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                   num_draft: Tensor, keys: RowKeys) -> tuple[Tensor, Tensor]:
    """Lossless speculative sampling over a chain of draft tokens.

    draft_ids (B, K) long; draft_probs (B, K, V) float, or None for a deterministic draft;
    target_probs (B, K+1, V) float (from ``logits_to_probs``); num_draft (B,) long; keys: each row's
    seed and next position -> (out_ids (B, K+1) long, num_accepted (B,) long). Draft i is tested with
    the ACCEPT uniform of position base + i (sub i); the emitted token is the Gumbel-max draw of its
    own position.
    """
    B, K, V = _check_sampled(draft_ids, draft_probs, target_probs, num_draft, keys)
    dev = draft_ids.device
    p = target_probs.float()  # (B, K+1, V)
    pos = torch.arange(K + 1, device=dev)  # (K+1,)
    valid = pos[None, :K] < num_draft[:, None]  # (B, K)
    x = torch.where(valid, draft_ids, 0).clamp(0, V - 1)  # (B, K) padding -> a safe index
    p_x = p[:, :K].gather(-1, x[..., None])[..., 0]  # (B, K)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # (B, K)
        fixed = torch.ones_like(valid)  # (B, K) deterministic proposal everywhere
    else:
        q_x = draft_probs.float().gather(-1, x[..., None])[..., 0]  # (B, K)
        fixed = q_x <= 0.0  # x could not have been sampled from q: use the one-hot rule here
        q_x = torch.where(fixed, 1.0, q_x)

    # 1. accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), up to the first rejection
    u = keys.uniform(K, ACCEPT, sub=torch.arange(K, device=dev))  # (B, K) float64 in [0, 1)
    num_accepted = _prefix_length((u < p_x / q_x) & valid)  # (B,)

    # 2. recovered token (residual at the first rejection) or bonus token (p after the last draft)
    rows = torch.arange(B, device=dev)
    p_next = p[rows, num_accepted]  # (B, V)
    weights = p_next
    if K > 0:
        j = num_accepted.clamp(max=K - 1)  # (B,) the rejected position, where there is one
        q_next = torch.zeros_like(p_next).scatter_(1, x[rows, j][:, None], 1.0)  # (B, V) one-hot
        if draft_probs is not None:
            q_next = torch.where(fixed[rows, j][:, None], q_next, draft_probs[rows, j].float())
        residual = (p_next - q_next).clamp_(min=0.0)  # (B, V)
        use_residual = (num_accepted < num_draft) & (residual.sum(-1) > 0)  # (B,) else p itself
        weights = torch.where(use_residual[:, None], residual, p_next)  # (B, V)
    next_ids = keys.gumbel_argmax(weights, num_accepted)  # (B,) at position base + num_accepted

    out_ids = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)  # (B, K+1)
    out_ids[:, :K] = torch.where(pos[None, :K] < num_accepted[:, None], draft_ids, -1)
    out_ids.scatter_(1, num_accepted[:, None], next_ids[:, None])
    return out_ids, num_accepted


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """max(0, p - q): what is left of the target's law once a draft from q was rejected."""
    return (p - q).clamp_(min=0.0)


def _tree_outputs(draft_ids: Tensor, parents: Tensor, leaf: Tensor, num_accepted: Tensor,
                  next_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(out_ids (B, K+1), num_accepted (B,), path (B, K)) from each row's accepted leaf (-1: none)."""
    B, K = draft_ids.shape
    par, ids, leaves, nxt = parents.tolist(), draft_ids.tolist(), leaf.tolist(), next_ids.tolist()
    out = torch.full((B, K + 1), -1, dtype=torch.long)
    path = torch.full((B, K), -1, dtype=torch.long)
    for b in range(B):
        nodes, n = [], leaves[b]
        while n >= 0:  # up from the leaf to the root
            nodes.append(n)
            n = par[b][n]
        nodes.reverse()
        if nodes:
            path[b, :len(nodes)] = torch.tensor(nodes)
            out[b, :len(nodes)] = torch.tensor([ids[b][n] for n in nodes])
        out[b, len(nodes)] = nxt[b]
    dev = draft_ids.device
    return out.to(dev), num_accepted, path.to(dev)


def verify_tree_greedy(draft_ids: Tensor, parents: Tensor, target_logits: Tensor,
                       num_draft: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The longest path of draft nodes whose every token is the target's argmax, then the argmax.

    draft_ids (B, K) long, parents (B, K) long (see the module docstring), target_logits (B, K+1, V)
    (position 0: the pending token, 1 + i: node i), num_draft (B,) long -> (out_ids (B, K+1),
    num_accepted (B,), path (B, K)). Ties between equally deep paths: the lowest leaf index.
    """
    B, K = _check(draft_ids, target_logits, num_draft)
    dev = draft_ids.device
    target_ids = target_logits.argmax(-1)  # (B, K+1)
    rows = torch.arange(B, device=dev)
    valid = torch.arange(K, device=dev)[None, :] < num_draft[:, None]  # (B, K)
    ok = torch.zeros(B, K, dtype=torch.bool, device=dev)  # node i and all its ancestors match
    depth = torch.zeros(B, K, dtype=torch.long, device=dev)
    for i in range(K):
        p = parents[:, i]  # (B,)
        root, pc = p < 0, p.clamp(min=0)
        ok[:, i] = valid[:, i] & (root | ok[rows, pc]) & (draft_ids[:, i] == target_ids[rows, p + 1])
        depth[:, i] = torch.where(root, 1, depth[rows, pc] + 1)
    score = torch.where(ok, depth, 0)  # (B, K)
    if K == 0:
        return target_ids[:, :1].clone(), torch.zeros(B, dtype=torch.long, device=dev), draft_ids.clone()
    num_accepted, leaf = score.max(-1).values, score.argmax(-1)  # argmax: the first of the deepest
    leaf = torch.where(num_accepted > 0, leaf, -1)
    next_ids = target_ids[rows, leaf + 1]  # (B,) the argmax after the leaf (after the pending token: none)
    return _tree_outputs(draft_ids, parents, leaf, num_accepted, next_ids)


def verify_tree_sampled(draft_ids: Tensor, parents: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                        num_draft: Tensor, keys: RowKeys) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless multi-draft rejection sampling over a tree (see the module docstring).

    draft_ids (B, K) long; parents (B, K) long; draft_probs (B, K, V): the distribution each node
    was drawn from given its earlier siblings, or None (deterministic tree: one-hot proposals);
    target_probs (B, K+1, V); num_draft (B,) long; keys: each row's seed and next position ->
    (out_ids (B, K+1), num_accepted (B,), path (B, K)). Node i (depth d) tests with the ACCEPT
    uniform of position base + d - 1, sub i; the emitted token is the Gumbel-max draw of its position,
    as in the chain (on ``parents = i - 1`` the draws are the chain's).

    Nodes are visited in index order; as parents precede children, node i is the next untried child
    of the row's current node exactly when its parent is that node, so the walk is one pass over K
    with every row at once.
    """
    B, K, V = _check_sampled(draft_ids, draft_probs, target_probs, num_draft, keys)
    dev = draft_ids.device
    P = target_probs.float()  # (B, K+1, V)
    rows = torch.arange(B, device=dev)
    valid = torch.arange(K, device=dev)[None, :] < num_draft[:, None]  # (B, K)
    depth = torch.zeros(B, K, dtype=torch.long, device=dev)
    for i in range(K):
        pd = parents[:, i].clamp(min=0)
        depth[:, i] = torch.where(parents[:, i] < 0, 1, depth[rows, pd] + 1)
    u = keys.uniform((depth - 1).clamp(min=0), ACCEPT, sub=torch.arange(K, device=dev))  # (B, K) float64
    p = P[:, 0].clone()  # (B, V) the current law of the next token (a residual after rejections)
    cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # current node (-1: the pending token)
    num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
    for i in range(K):
        x = draft_ids[:, i].clamp(0, V - 1)  # (B,)
        tried = valid[:, i] & (parents[:, i] == cur)  # (B,)
        if not bool(tried.any()):
            continue
        one_hot = torch.zeros(B, V, device=dev).scatter_(1, x[:, None], 1.0)  # (B, V)
        q = one_hot
        if draft_probs is not None:
            qi = draft_probs[:, i].float()  # (B, V)
            q = torch.where((qi[rows, x] > 0)[:, None], qi, one_hot)  # q(x) = 0: the one-hot rule
        p_x = p[rows, x] / p.sum(-1)
        accepted = tried & (u[:, i] < p_x / q[rows, x])  # (B,)
        rejected = tried & ~accepted
        r = _residual(p, q)  # (B, V)
        mass = r.sum(-1, keepdim=True)  # (B, 1)
        p = torch.where((rejected & (mass[:, 0] > 0))[:, None], r / mass.clamp(min=1e-30), p)
        p = torch.where(accepted[:, None], P[:, 1 + i], p)
        num_accepted = torch.where(accepted, depth[:, i], num_accepted)
        cur = torch.where(accepted, i, cur)
    next_ids = keys.gumbel_argmax(p, num_accepted)  # (B,) recovered (the residual) or bonus (p after the leaf)
    return _tree_outputs(draft_ids, parents, cur, num_accepted, next_ids)
