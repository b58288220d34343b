"""End to end: speculative samples follow the target's exact distribution (temperature, top-k, top-p).

The exact law of the first two generated tokens is computed from the target model itself; many
seeded speculative generations (and plain ones) are compared with it by a chi-square test at
significance ALPHA. Seeds are fixed, so a run is deterministic; a correct sampler fails with
probability ALPHA per test over the choice of seeds (the stated false-failure rate). The last test
shows the statistic has the power to catch a subtly wrong verifier.
"""
from __future__ import annotations

import re

import pytest
import torch
from scipy.stats import chisquare

import specdec.engine.step
from conftest import CONSTRAINED_ONLY, EXTRA_TREES, SUITE_VARIANTS, logits_of, make_model_dir, spec_method_config
from specdec import LLM, SamplingParams
from specdec.sampling.grammar import unpack
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import ACCEPT

ALPHA = 1e-3
N = 3000
PROMPT = "Hello world. Hello world. Hello"  # repeats, so n-gram lookup finds drafts too


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    # a sharper lm head gives a peaked target, so that top-k / top-p really cut the support
    target = make_model_dir(root / "target", layers=4, hidden=64, seed=0, scale=6.0)
    draft = make_model_dir(root / "draft", layers=1, hidden=32, seed=5, scale=6.0)
    return target, draft


def exact_joint(llm: LLM, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x1, x2) of the target under ``params``, by enumerating x1."""
    model = llm.target.model
    ids = llm.tokenizer.encode(PROMPT)
    st = SamplingTensors.from_params([params])
    with torch.inference_mode():
        logits = logits_of(model, ids)
        p1 = logits_to_probs(penalized(logits[:, -1], ids, [], params), st)[0]
        joint = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            seq = ids + [x1]
            lg = logits_of(model, seq)
            p2 = logits_to_probs(penalized(lg[:, -1], ids, [x1], params), st)[0]
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """(1, V) logits after logit bias, vLLM's repetition penalty and OpenAI's frequency / presence
    penalties, straight from their definitions (dense; independent of sampling/penalties.py)."""
    x = logits.float().clone()
    V = x.shape[-1]
    for t, b in (p.logit_bias or {}).items():
        x[0, t] += b
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()  # (V,)
    seen = counts > 0
    seen[torch.tensor(prompt, dtype=torch.long)] = True
    r = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def chi2_pvalue(samples: list[tuple[int, int]], joint: dict) -> float:
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * len(samples) >= 5]
    rest = 1.0 - sum(joint[c] for c in big)
    counts = {c: 0 for c in big}
    other = 0
    for s in samples:
        assert s in joint, f"sampled {s}, which has probability 0 under the target"
        if s in counts:
            counts[s] += 1
        else:
            other += 1
    obs = [counts[c] for c in big] + ([other] if rest > 0 else [])
    exp = [joint[c] * len(samples) for c in big] + ([rest * len(samples)] if rest > 0 else [])
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def sample_pairs(llm: LLM, params: SamplingParams) -> list[tuple[int, int]]:
    outs = llm.generate([PROMPT] * N, [params.replace(seed=i) for i in range(N)])
    return [tuple(o.outputs[0].token_ids[:2]) for o in outs]


PARAMS = [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=8, top_p=0.9, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02, max_tokens=3, ignore_eos=True),
]


def in_default_run(methods: list[str], keep: tuple[str, ...]) -> list:
    """``methods`` as parameters, those not in ``keep`` in the slow stage (the default run stays short)."""
    return [m if m in keep else pytest.param(m, marks=pytest.mark.slow) for m in methods]


CORE = ("draft_model", "draft_model-tree", "ngram", "eagle")
PARAM_IDS = ["t1", "t0.8-k8-p0.9", "t1.3-p0.8-minp"]


@pytest.mark.parametrize("method,params", [
    pytest.param(m, p, id=f"{pid}-{m}",
                 # the core methods by default at t1, the draft model and n-gram also at t0.8-k8-p0.9; every other method
                 # and setting in the slow stage (each method's sampling is also checked in the default run by
                 # test_seeded.py: Gumbel verification equal to plain sampling, token for token)
                 marks=() if m in CORE and (pid == "t1" or (pid == "t0.8-k8-p0.9" and m in ("draft_model", "ngram")))
                 else pytest.mark.slow)
    for m in SUITE_VARIANTS + EXTRA_TREES for p, pid in zip(PARAMS, PARAM_IDS)
    if m != "mtp" or pid == "t1"])  # mtp: one setting (its drafts are checked against transformers' in test_mtp.py)
def test_speculative_samples_follow_the_target(models, params, method):
    target, draft = models
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config=spec_method_config(method, draft) | {"num_speculative_tokens": 3})
    joint = exact_joint(llm, params)
    pairs = sample_pairs(llm, params)
    m = llm.generate(PROMPT, params.replace(seed=0))[0].metrics
    assert m.num_draft_tokens > 0
    assert chi2_pvalue(pairs, joint) > ALPHA


PENALIZED = SamplingParams(temperature=0.9, top_k=16, max_tokens=3, ignore_eos=True, presence_penalty=1.5,
                           frequency_penalty=0.7, repetition_penalty=1.6, logit_bias={11: 2.5, 20: -1.5})


@pytest.mark.parametrize("method", in_default_run(SUITE_VARIANTS + EXTRA_TREES, ("draft_model",)))
def test_samples_with_penalties_follow_the_penalized_target(models, method):
    """The second token's law depends on the first through the penalties: drafts and verification
    must both count it (and the drafts before each verified position)."""
    target, draft = models
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config=spec_method_config(method, draft) | {"num_speculative_tokens": 3})
    joint = exact_joint(llm, PENALIZED)
    unpenalized = exact_joint(llm, PENALIZED.replace(presence_penalty=0.0, frequency_penalty=0.0,
                                                     repetition_penalty=1.0, logit_bias=None))
    assert sum(abs(joint.get(c, 0.0) - unpenalized.get(c, 0.0)) for c in joint | unpenalized) > 0.1
    assert llm.generate(PROMPT, PENALIZED.replace(seed=0))[0].metrics.num_draft_tokens > 0
    assert chi2_pvalue(sample_pairs(llm, PENALIZED), joint) > ALPHA


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_samples_follow_a_quantized_target(models, method):
    """The same check with the target (and draft) on the int4/int8 kernels."""
    target, draft = models
    cfg = spec_method_config(method, draft) | {"num_speculative_tokens": 3}
    if method == "draft_model":
        cfg["quantization"] = "int8"
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512, quantization="int4",
              speculative_config=cfg)
    params = PARAMS[1]
    assert chi2_pvalue(sample_pairs(llm, params), exact_joint(llm, params)) > ALPHA


def test_plain_samples_follow_the_target(models):
    llm = LLM(model=str(models[0]), dtype="float32", progress=False, max_num_seqs=512)
    params = PARAMS[1]
    assert chi2_pvalue(sample_pairs(llm, params), exact_joint(llm, params)) > ALPHA


@pytest.mark.parametrize("method", in_default_run(list(CORE), ("draft_model", "ngram")))
def test_gumbel_verified_samples_follow_the_target(models, method):
    """verify="gumbel" (Gumbel-max with keyed noise, drafts checked by equality): the same test."""
    target, draft = models
    cfg = spec_method_config(method, draft) | {"num_speculative_tokens": 3, "verify": "gumbel"}
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512, speculative_config=cfg)
    params = PARAMS[1]
    assert llm.generate(PROMPT, params.replace(seed=0))[0].metrics.num_draft_tokens > 0
    assert chi2_pvalue(sample_pairs(llm, params), exact_joint(llm, params)) > ALPHA


@pytest.mark.slow  # the statistic's power, checked in the slow stage (11 s)
def test_the_statistic_catches_a_gumbel_verifier_that_keeps_the_drafts(models, monkeypatch):
    """Accepting every draft token (the drafter's own Gumbel-max samples) emits the draft's law."""
    def keep_drafts(draft_ids, target_probs, num_draft, keys):
        B, K = draft_ids.shape
        rows = torch.arange(B, device=draft_ids.device)
        pos = torch.arange(K + 1, device=draft_ids.device)[None]
        out = torch.where(pos < num_draft[:, None], torch.cat([draft_ids, draft_ids[:, :1]], 1), -1)
        out[rows, num_draft] = keys.gumbel_argmax(target_probs[rows, num_draft], num_draft)
        return out, num_draft.clone()

    monkeypatch.setattr(specdec.engine.step, "verify_gumbel", keep_drafts)
    target, draft = models
    cfg = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "verify": "gumbel"}
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512, speculative_config=cfg)
    params = PARAMS[0]
    assert chi2_pvalue(sample_pairs(llm, params), exact_joint(llm, params)) < ALPHA


@pytest.mark.slow  # the statistic's power, checked in the slow stage (15 s)
def test_the_statistic_catches_a_subtly_wrong_verifier(models, monkeypatch):
    """Rejected draft tokens resampled from p instead of the residual max(0, p - q): biased."""
    right = specdec.engine.step.verify_sampled

    def wrong(draft_ids, draft_probs, target_probs, num_draft, keys):
        B, K = draft_ids.shape
        if K == 0:
            return right(draft_ids, draft_probs, target_probs, num_draft, keys)
        u = keys.uniform(K + 1, ACCEPT)
        p_x = target_probs[:, :K].gather(-1, draft_ids[..., None])[..., 0]
        q_x = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
        dev = draft_ids.device
        ok = ((u[:, :K] < p_x / q_x) & (torch.arange(K, device=dev)[None] < num_draft[:, None])).long().cumprod(-1)
        n = ok.sum(-1)
        nxt = torch.stack([torch.multinomial(target_probs[b, n[b]], 1)[0] for b in range(B)])
        out = torch.where(torch.arange(K + 1, device=dev)[None] < n[:, None], torch.cat([draft_ids, draft_ids[:, :1]], 1), -1)
        out[torch.arange(B, device=dev), n] = nxt
        return out, n

    monkeypatch.setattr(specdec.engine.step, "verify_sampled", wrong)
    torch.manual_seed(0)
    target, draft = models
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    params = PARAMS[0]
    assert chi2_pvalue(sample_pairs(llm, params), exact_joint(llm, params)) < ALPHA


LETTERS = "[a-h]+"  # the legal set of each position is known without the grammar engine
CONSTRAINED = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, structured_output={"regex": LETTERS})


def letters_joint(llm: LLM, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x1, x2) of the target renormalised over the legal tokens of ``[a-h]+``, the legal sets found by
    decoding every token (independent of the grammar engine): x1 a non-empty run of a-h, x2 another
    or the end of the sequence."""
    tok = llm.tokenizer
    V = llm.target.config.vocab_size
    letters = torch.tensor([bool(re.fullmatch("[a-h]+", tok.decode([t]))) if t < tok.vocab_size else False
                            for t in range(V)])
    end = letters.clone()
    end[sorted(tok.eos_token_ids)] = True
    model = llm.target.model
    ids = tok.encode(PROMPT)
    st = SamplingTensors.from_params([params])
    with torch.inference_mode():
        logits = logits_of(model, ids)
        p1 = logits_to_probs(logits[:, -1].float().masked_fill(~letters, float("-inf")), st)[0]
        joint = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            seq = ids + [x1]
            lg = logits_of(model, seq)
            p2 = logits_to_probs(lg[:, -1].float().masked_fill(~end, float("-inf")), st)[0]
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


@pytest.mark.parametrize("method", in_default_run(SUITE_VARIANTS + CONSTRAINED_ONLY,
                                                  ("draft_model", "draft_model-tree", "ngram", "grammar")))
def test_constrained_samples_follow_the_masked_target(models, method):
    """Under a constraint the law is the target's renormalised over the legal tokens; every drafter's
    q is masked by the same matcher, advanced through its draft."""
    target, draft = models
    cfg = spec_method_config(method, draft)
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config=cfg | {"num_speculative_tokens": 3})
    joint = letters_joint(llm, CONSTRAINED)
    assert llm.generate(PROMPT, CONSTRAINED.replace(seed=0))[0].metrics.num_draft_tokens > 0 or method == "grammar"
    assert chi2_pvalue(sample_pairs(llm, CONSTRAINED), joint) > ALPHA


@pytest.mark.slow  # 45 s: the slow stage
def test_the_statistic_catches_a_verifier_that_masks_only_the_target(models, monkeypatch):
    """The common shortcut: mask the target, let the drafter draft unmasked and drop its draft from its
    first illegal token on. The dropped tokens' q mass then goes missing from the rejection rule: biased."""
    import specdec.proposers.base
    import specdec.proposers.grammar

    monkeypatch.setattr(specdec.proposers.base.DraftMasks, "from_seqs", classmethod(lambda cls, seqs: None))
    inner = specdec.proposers.grammar.GrammarForced._inner

    def truncated(self, seqs, ks):
        d = inner(self, seqs, ks)
        d.num_tokens = torch.tensor([s.matcher.legal_prefix(d.tokens[b, :int(d.num_tokens[b])].tolist())[0]
                                     for b, s in enumerate(seqs)], device=d.tokens.device)
        return d

    monkeypatch.setattr(specdec.proposers.grammar.GrammarForced, "_inner", truncated)
    target, draft = models
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    outs = llm.generate([PROMPT] * 3 * N, [CONSTRAINED.replace(seed=i) for i in range(3 * N)])  # a subtle bias
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert chi2_pvalue(pairs, letters_joint(llm, CONSTRAINED)) < ALPHA


FORCED = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, structured_output={"regex": "[a-h]=[a-h]+"})


def masked_joint(llm: LLM, params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(x1..xn) of the target renormalised at each position over the legal set the grammar engine
    gives (its masks only; the law is built here from the model's logits)."""
    model, tok = llm.target.model, llm.tokenizer
    ids = tok.encode(PROMPT)
    st = SamplingTensors.from_params([params])
    V = llm.target.config.vocab_size
    matcher = llm.grammars.matcher(params.structured_output)
    out: dict[tuple, float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == n:
            out[tuple(prefix)] = prob
            return
        bits = torch.zeros(matcher.words, dtype=torch.int32)
        matcher.fill(bits)
        allowed = unpack(bits, V)
        seq = ids + prefix
        lg = logits_of(model, seq)[:, -1]
        p = logits_to_probs(lg.float().masked_fill(~allowed, float("-inf")), st)[0]
        for x in torch.nonzero(p).flatten().tolist():
            matcher.m.try_consume_tokens([x])
            walk(prefix + [x], prob * float(p[x]))
            matcher.m.rollback(1)

    walk([], 1.0)
    return out


@pytest.mark.parametrize("method", in_default_run(["draft_model", "draft_model-tree", "ngram", "suffix", "grammar"],
                                                  ("draft_model",)))
def test_samples_with_forced_tokens_in_the_draft_follow_the_masked_target(models, method):
    """A forced token between two free ones: drafters that continue after it (draft model, n-gram,
    suffix) draft behind it in the same block, their q masked by the matcher advanced through it."""
    target, draft = models
    cfg = spec_method_config(method, draft)
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config=cfg | {"num_speculative_tokens": 3})
    joint = masked_joint(llm, FORCED, 3)
    assert {k[1] for k in joint} == {llm.tokenizer.encode("=", add_special_tokens=False)[0]}  # forced
    outs = llm.generate([PROMPT] * N, [FORCED.replace(seed=i) for i in range(N)])
    assert sum(o.metrics.num_accepted_tokens for o in outs) >= N  # the forced token at least
    assert chi2_pvalue([tuple(o.outputs[0].token_ids[:3]) for o in outs], joint) > ALPHA


@pytest.mark.parametrize("method", in_default_run(["draft_model", "layer_skip-int4-tree"], ("draft_model",)))
def test_mixed_batches_keep_each_rows_law(models, method):
    """Greedy and sampled rows with different temperatures and top-p in one batch, per-row draft
    lengths from adaptive K, a confidence stop that ends drafts early (rows shorter than the batch's
    widest), and the model drafter's bonus token: every greedy row is plain greedy decoding, every
    sampled row follows its own law."""
    target, draft = models
    cfg = spec_method_config(method, draft) | {"num_speculative_tokens": 4, "adaptive": True,
                                                "draft_confidence_threshold": 0.5}
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512, speculative_config=cfg)
    kinds = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), PARAMS[0], PARAMS[1]]
    params = [kinds[i % 3].replace(seed=i) for i in range(3 * N)]
    outs = llm.generate([PROMPT] * len(params), params)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    greedy = LLM(model=str(target), dtype="float32", progress=False).generate(PROMPT, kinds[0])[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == greedy for o in outs[0::3])
    for j in (1, 2):
        pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs[j::3]]
        assert chi2_pvalue(pairs, exact_joint(llm, kinds[j])) > ALPHA
