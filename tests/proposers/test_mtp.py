"""The mtp proposer: a GLM-4.5-style target's own multi-token-prediction layers draft exactly what
transformers' MTP drafting (``MtpModel``, ``MTPCandidateGenerator``: ``generate(..., use_mtp=True)``) drafts
from the same weights and tokens, step after step of a real run (its speculative cache entries redone
after rejections); the output is plain greedy's; clear errors for a target without MTP layers.
(Losslessness on the suites' target with MTP layers added: tests/proposers/test_lossless_suite.py and
test_distribution.py, through conftest's ``add_mtp_layers``.)"""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import CORPUS
from glm_util import glm_dir, reference
from specdec import LLM, SamplingParams
from specdec.engine import budget
from specdec.errors import SpecdecError
from specdec.proposers.mtp import MtpProposer

transformers = pytest.importorskip("transformers")
PROMPTS = [CORPUS[0] + CORPUS[2], CORPUS[1] + " " + CORPUS[3]]  # two rows of different lengths
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mtp")


@pytest.fixture(autouse=True)
def draft_every_step(monkeypatch):
    """Every step drafts K: the MoE target's cost policy (``CostAwareK``) would stop drafting for random MTP
    layers that are seldom accepted, and these tests compare drafts."""
    monkeypatch.setattr(budget, "best_k", lambda costs, alpha, k_max, *a, **kw: k_max)


class Recording(MtpProposer):
    """Keeps each row's tokens and the draft made after them; with ``schedule``, step i drafts at most
    ``schedule[i % len]`` tokens (as an adaptive K would)."""

    def __init__(self, inner: MtpProposer, schedule: tuple[int, ...] = ()) -> None:
        super().__init__(inner.mtp, inner.embed, inner.lm_head, inner.confidence_threshold)
        self.seen: list[tuple[list[int], list[int]]] = []
        self.schedule, self.calls = schedule, 0

    def propose(self, seqs, ks):
        if self.schedule:
            ks = [min(k, self.schedule[self.calls % len(self.schedule)]) for k in ks]
            self.calls += 1
        draft = super().propose(seqs, ks)
        for i, s in enumerate(seqs):
            n = int(draft.num_tokens[i])
            if n:
                self.seen.append((list(s.tokens), draft.tokens[i, :n].tolist()))
        return draft


def transformers_mtp(path, monkeypatch):
    """transformers' model of ``path`` and its MtpModel, loaded by transformers from the checkpoint."""
    from transformers.modeling_layers import MtpModel

    ref = reference(path, monkeypatch)
    return ref, MtpModel.from_pretrained(ref)


@torch.no_grad()
def transformers_drafts(ref, mtp, tokens: list[int], k: int, states: torch.Tensor | None = None) -> list[int]:
    """The greedy drafts transformers' MTP makes after ``tokens``: MTPCandidateGenerator's call on a fresh
    cache (the main model's hidden states of positions 0..N-2, tokens 1..N-1 at positions 1..N-1), run as
    ``MtpModel.forward``'s loop (layer i drafts token i + 1, the tokens and positions rolled by one each
    layer); past the layers, the last layer again on its own output and the token just drafted (one entry
    each, its cache appended), as our proposer goes on. ``states``: the main model's last hidden states
    ``(1, >= N - 1, C)`` of a sequence ``tokens`` begins (causal: the same as of ``tokens`` alone)."""
    from transformers.cache_utils import MtpCache

    n, layers = len(tokens), len(mtp.layers)
    ids = torch.tensor([tokens])
    if states is None:
        states = ref(ids, output_hidden_states=True).hidden_states[-1]
    hidden = states[:, :n - 1]
    cache = MtpCache(config=ref.config.get_mtp_config())
    inp, pos, out = ids[:, 1:], torch.arange(1, n)[None], []
    for i in range(k):
        hidden = mtp.forward_layer(min(i, layers - 1), hidden, pos, cache, input_ids=inp)
        tok = mtp.shared_head(hidden[:, -1:]).argmax(-1)  # (1, 1)
        out.append(int(tok))
        if i + 1 < layers:
            inp, pos = torch.cat([inp[:, 1:], tok], 1), torch.cat([pos[:, 1:], pos[:, -1:] + 1], 1)
        else:
            inp, pos, hidden = tok, pos[:, -1:] + 1, hidden[:, -1:]
    return out


@pytest.mark.parametrize(("layers", "predictive", "k", "more"), [
    (1, True, 1, {}), (1, True, 3, {}), (2, False, 2, {}), (2, True, 4, {"chunk": 8}),
    (2, True, 3, {"schedule": (1, 1, 3, 2)})],
    ids=["1-layer-k1", "1-layer-k3", "2-layers-rejected-k2", "2-layers-k4-chunked-prefill", "2-layers-varying-k"])
def test_drafts_equal_transformers_mtp_drafting(root, monkeypatch, layers, predictive, k, more):
    """fp32, batch 2: every draft of the run equals transformers' MTP drafting after the same tokens
    (K up to the layers: its own; beyond: its last layer chained), whatever was accepted or rejected
    before; the output is plain greedy's; drafts are rejected (random layers: nearly all), and with
    predictive layers (glm_util) a third or more accepted. Also with the prompt's hidden states arriving in
    chunks of 8, and with K varying from step to step (steps drafting one token leave the second layer
    behind; it catches up when a later step runs it)."""
    path = glm_dir(root, mtp_layers=layers, predictive=predictive)
    llm = LLM(model=str(path), dtype="float32", progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    llm.runner.prefill_chunk = more.get("chunk", llm.runner.prefill_chunk)
    rec = Recording(llm.proposer, more.get("schedule", ()))
    llm.proposer = rec
    outs = llm.generate(PROMPTS, GREEDY)
    plain = llm.generate(PROMPTS, GREEDY, num_speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted < drafted and (accepted > drafted // 3 if predictive else True)
    lengths = {len(d) for _, d in rec.seen}
    assert len(rec.seen) >= 2 * 24 // (k + 1) and max(lengths) == k and (1 in lengths or "schedule" not in more)
    ref, mtp = transformers_mtp(path, monkeypatch)
    with torch.no_grad():  # each row's final sequence, once: every prefix's hidden states are a part of them
        finals = [torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids]) for o in outs]
        states = [ref(ids, output_hidden_states=True).hidden_states[-1] for ids in finals]
    for tokens, draft in rec.seen:
        row = next(i for i, ids in enumerate(finals) if ids[0, :len(tokens)].tolist() == tokens)
        assert draft == transformers_drafts(ref, mtp, tokens, len(draft), states[row]), len(tokens)


@pytest.mark.parametrize("layers", [1, 2])
def test_the_reference_is_transformers_own_generator(root, monkeypatch, layers):
    """``transformers_drafts`` reproduces transformers' MTPCandidateGenerator: each candidate block of
    ``generate(use_mtp=True)`` (which crops and recomputes its MTP cache after a rejection) is what it
    gives after the same tokens, and the generator's output is plain greedy's."""
    from transformers.generation import candidate_generator

    path = glm_dir(root, mtp_layers=layers, predictive=True)
    ref, mtp = transformers_mtp(path, monkeypatch)
    seen = []
    own = candidate_generator.MTPCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        out = own(self, input_ids, *args, **kwargs)
        seen.append((input_ids[0].tolist(), out[0][0, input_ids.shape[1]:].tolist()))
        return out

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", spy)
    ids = torch.tensor([prompt_ids(path)])
    with torch.no_grad():
        got = ref.generate(ids, max_new_tokens=16, do_sample=False, use_mtp=True, pad_token_id=0)
        want = ref.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()
    blocks = [(t, d) for t, d in seen if d]
    steps = {len(b[0]) - len(a[0]) for a, b in zip(blocks, blocks[1:])}
    assert len(blocks) >= 4 and (layers == 1 or (1 in steps and max(steps) > 1))  # 2 layers: a crop, and none
    for tokens, draft in blocks:
        assert draft == transformers_drafts(ref, mtp, tokens, layers)


def prompt_ids(path) -> list[int]:
    from specdec.models.tokenizer import Tokenizer

    return Tokenizer(path).encode(PROMPTS[0])


def test_bf16_and_sampled_runs_are_plain_decodings(root):
    """bf16 (the MTP layers' products on the native tiles where built; the router's bias fp32): greedy
    output is plain greedy's; a seeded sampled request verified by Gumbel-max equality gets plain
    sampling's tokens, speculation on or off."""
    path = glm_dir(root, mtp_layers=2, predictive=True)
    llm = LLM(model=str(path), dtype="bfloat16", progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "verify": "gumbel"})
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, num_speculative_tokens=0)]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=24, ignore_eos=True, seed=5)
    want = llm.generate(PROMPTS, sampled, num_speculative_tokens=0)
    got = llm.generate(PROMPTS, sampled)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0


def test_a_target_without_mtp_layers_is_one_clear_error(root, tiny_model_dir, tmp_path):
    with pytest.raises(SpecdecError, match="has no multi-token-prediction layers"):
        LLM(model=str(tiny_model_dir), dtype="float32", progress=False, speculative_config={"method": "mtp"})
    # a GLM-4.5 checkpoint whose MTP layers were stripped, its config.json still stating one
    from safetensors.torch import load_file, save_file

    stripped = tmp_path / "stripped"
    shutil.copytree(glm_dir(root, mtp_layers=1, predictive=True), stripped)
    weights = load_file(str(stripped / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.3.")},
              str(stripped / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecdecError, match=r"states 1 \(num_nextn_predict_layers\) but its weights hold no "
                                           r"model\.layers\.3\.eh_proj\.weight"):
        LLM(model=str(stripped), dtype="float32", progress=False, speculative_config={"method": "mtp"})
