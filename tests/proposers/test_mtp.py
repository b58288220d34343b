"""The mtp proposer: a GLM-4.5-style target's own multi-token-prediction layers draft exactly what
transformers' MTP drafting (``MtpModel``, ``MTPCandidateGenerator``: ``generate(..., use_mtp=True)``) drafts
from the same weights and tokens, step after step of a real run (its speculative cache entries redone
after rejections); the output is plain greedy's; clear errors for a target without MTP layers. Qwen3.5's
MTP block (``mtp.*``, a full-attention layer beside a hybrid target): its logits are vLLM's formulas on
transformers' decoder layer, in a text and a multimodal checkpoint and from a GGUF file of ``qwen35``, and
greedy speculation with it is plain greedy's.
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
    from specdec.formats.tokenizer import Tokenizer

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


# Qwen3.5's MTP block (``mtp.*``: heads/mtp.py), on a tiny random Qwen3.5 built by transformers' own classes
QWEN_MTP_FILE = "model-mtp.safetensors"  # a second shard (llama.cpp's converter reads model*.safetensors)


def qwen_mtp_dir(root):
    """``family_util``'s tiny Qwen3.5 (three delta-net layers, then attention) with one MTP layer written beside its
    weights as Qwen3.5's checkpoints hold it: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.norm`` and a full-attention decoder layer ``mtp.layers.0.*`` (random; every norm zero-centred, moved off
    0), and ``"mtp_num_hidden_layers": 1`` in config.json. Predictive: its ``fc`` passes the token's embedding on
    (plus a little of the hidden state) and the target's final norm comes after the layer, so that drafts are
    often accepted (the target's layers are small beside its embeddings: its next token nearly follows from its
    last one), not always."""
    import json

    from safetensors.torch import load_file, save_file

    from family_util import family_dir

    out = root / "qwen3_5-mtp"
    if (out / "config.json").is_file():
        return out
    tmp = root / f".{out.name}.tmp"
    shutil.copytree(family_dir(root, "qwen3_5"), tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    sd = load_file(str(tmp / "model.safetensors"))
    C, gen = cfg["hidden_size"], torch.Generator().manual_seed(11)
    attn = cfg["layer_types"].index("full_attention")  # its tensors' names and shapes are the MTP layer's
    mtp = {f"mtp.layers.0.{k.split('.', 3)[3]}": (0.2 if "norm" in k else 0.02) * torch.randn(v.shape, generator=gen)
           for k, v in sd.items() if k.startswith(f"model.layers.{attn}.")}
    mtp["mtp.fc.weight"] = torch.cat([torch.eye(C), 0.02 * torch.randn(C, C, generator=gen)], 1)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        mtp[f"mtp.{norm}.weight"] = 0.2 * torch.randn(C, generator=gen)
    mtp["mtp.norm.weight"] = sd["model.norm.weight"].clone()
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(tmp / QWEN_MTP_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg | {"mtp_num_hidden_layers": 1}, indent=2))
    tmp.rename(out)
    return out


def as_multimodal(path, out):
    """Text checkpoint ``path`` as Qwen3.5 ships it, a Qwen3_5ForConditionalGeneration: config nested in
    ``text_config``, the language model's weights under ``model.language_model.``, the MTP block still top-level."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    text = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures": [
        "Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text}))
    sd = load_file(str(out / "model.safetensors"))
    save_file({("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def zero_centred_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@torch.no_grad()
def reference_qwen_mtp_logits(path, tokens: list[int]) -> torch.Tensor:
    """``(T - 1, V)``: the MTP layer's logits at entries 0..T-2 of ``tokens``, teacher-forced, from the formulas of
    vLLM's ``Qwen3_5MultiTokenPredictor`` (``qwen3_5_mtp.py``) on transformers' own model and decoder layer: entry p
    reads the target's hidden state at p after its final norm and the embedding of token p + 1 (at position p + 1),

        logits_p = lm_head(norm(layer(fc([pre_fc_norm_embedding(embed(x_{p+1})), pre_fc_norm_hidden(h_p)]))))

    ``layer``: transformers' Qwen3_5DecoderLayer of the target's config as a full-attention layer, loaded with
    ``mtp.layers.0.*``, causal over the entries."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg, w = ref.config, load_file(str(path / QWEN_MTP_FILE))
    layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")})
    ids, T, eps = torch.tensor([tokens]), len(tokens), cfg.rms_norm_eps
    h = ref.model(ids).last_hidden_state[:, :-1]  # (1, T-1, C) after the final norm
    e = ref.model.embed_tokens(ids[:, 1:])
    x = F.linear(torch.cat([zero_centred_norm(e, w["mtp.pre_fc_norm_embedding.weight"], eps),
                            zero_centred_norm(h, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1), w["mtp.fc.weight"])
    pos = torch.arange(1, T)[None]
    causal = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
    y = layer(x, ref.model.rotary_emb(x, pos[None].expand(3, 1, -1)), attention_mask=causal, position_ids=pos)
    return ref.lm_head(zero_centred_norm(y, w["mtp.norm.weight"], eps))[0]


def test_qwen3_5_mtp_logits_are_the_formulas_in_either_layout(root, tmp_path):
    """fp32: the MTP block loaded from ``mtp.*`` (its zero-centred norms folded), run over a prompt's entries
    after our target's prefill, gives at every position the logits of ``reference_qwen_mtp_logits`` (vLLM's
    formulas on transformers' decoder layer) within 1e-4; the same checkpoint as a multimodal one
    (``model.language_model.*``, MTP keys top-level) loads the same weights; the plain directory (no MTP
    weights) is one clear error."""
    from specdec.formats.hf import load_model_config, load_state_dict
    from specdec.models.llama import build_model
    from specdec.heads.mtp import load_mtp

    path = qwen_mtp_dir(root)
    cfg = load_model_config(path)
    target = build_model(cfg, load_state_dict(path, torch.float32), dtype=torch.float32)
    mtp = load_mtp(path, cfg, torch.float32)
    assert len(mtp.layers) == 1 and mtp.layers[0].block.kind == "attention" and mtp.config.layer_mixers is None
    tokens = prompt_ids(path)[:40]
    T = len(tokens)
    with torch.no_grad():
        ids = torch.tensor([tokens])
        h = target(ids, torch.arange(T)[None], target.new_cache(1, 64), hidden_layers=(-1,),
                   logits_positions="none").hidden[-1]
        out = mtp(0, target.embed(ids[:, 1:]), h[:, :-1], torch.arange(1, T)[None], torch.arange(T - 1)[None],
                  mtp.new_cache(1, 64), torch.tensor([0]))
        got = target.lm_head(out)[0]
    want = reference_qwen_mtp_logits(path, tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    multimodal = as_multimodal(path, tmp_path / "multimodal")
    assert load_model_config(multimodal) == cfg
    other = load_mtp(multimodal, cfg, torch.float32).state_dict()
    mine = mtp.state_dict()
    assert sorted(other) == sorted(mine) and all(torch.equal(other[k], mine[k]) for k in mine)
    from family_util import family_dir

    plain = family_dir(root, "qwen3_5")
    with pytest.raises(SpecdecError, match=r"no multi-token-prediction layers: its weights hold no mtp\.fc\.weight"):
        load_mtp(plain, load_model_config(plain), torch.float32)


@pytest.mark.parametrize(("dtype", "k"), [
    ("float32", 3), pytest.param("float32", 1, marks=pytest.mark.slow),
    pytest.param("bfloat16", 1, marks=pytest.mark.slow), pytest.param("bfloat16", 3, marks=pytest.mark.slow)])
def test_qwen3_5_greedy_mtp_is_plain_greedy(root, dtype, k):
    """Greedy speculation with the MTP block of a Qwen3.5 target (hybrid: its delta-nets' states kept by
    position) gives plain greedy's tokens, batch 2; drafts are made, many accepted (``qwen_mtp_dir``), some
    rejected."""
    path = qwen_mtp_dir(root)
    llm = LLM(model=str(path), dtype=dtype, progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    outs = llm.generate(PROMPTS, GREEDY)
    plain = llm.generate(PROMPTS, GREEDY, num_speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted >= 2 * 24 // (k + 1) and drafted // 4 < accepted < drafted, (drafted, accepted)


@pytest.mark.slow
def test_a_qwen3_5_target_without_its_mtp_block_is_one_clear_error(root, tmp_path):
    """Its MTP weights stripped while config.json still states them, the block's own weights or its layer
    missing, or a layer incomplete: one clear error each."""
    from safetensors.torch import load_file, save_file

    from specdec.formats.hf import load_model_config
    from specdec.heads.mtp import load_mtp

    path = qwen_mtp_dir(root)
    cfg = load_model_config(path)
    weights = load_file(str(path / QWEN_MTP_FILE))
    stripped = tmp_path / "stripped"
    shutil.copytree(path, stripped)
    (stripped / QWEN_MTP_FILE).unlink()
    stated = r"states 1 \(mtp_num_hidden_layers\) but its weights hold no "
    with pytest.raises(SpecdecError, match=stated + r"mtp\.fc\.weight"):
        LLM(model=str(stripped), dtype="float32", progress=False, speculative_config={"method": "mtp"})
    for drop, error in (("mtp.layers.", stated + r"mtp\.layers\.0\.\*"),
                        ("mtp.pre_fc_norm_hidden.", r"MTP block lacks mtp\.pre_fc_norm_hidden\.weight"),
                        ("mtp.layers.0.self_attn.k_proj.", r"MTP layers do not match its decoder's layers")):
        save_file({k: v for k, v in weights.items() if not k.startswith(drop)}, str(stripped / QWEN_MTP_FILE),
                  metadata={"format": "pt"})
        with pytest.raises(SpecdecError, match=error):
            load_mtp(stripped, cfg, torch.float32)


@pytest.mark.slow
def test_a_qwen3_5_gguf_file_holds_the_same_mtp_block(root, monkeypatch):
    """llama.cpp's converter writes the MTP block of a Qwen3.5 checkpoint by default (one more block, ``nextn.*``
    tensors, the +1 folded into every norm): the f32 file's conversion names it ``mtp.*`` again and states
    ``mtp_num_hidden_layers``, and it loads as the directory's block, bit for bit; greedy mtp speculation on the
    file gives plain greedy's tokens with drafts accepted."""
    import json

    from llamacpp_util import convert, llamacpp_source
    from specdec.formats import hub
    from specdec.formats.hf import load_model_config
    from specdec.heads.mtp import load_mtp

    src = llamacpp_source()
    path = qwen_mtp_dir(root)
    gguf = root / "qwen3_5-mtp.f32.gguf"
    if not gguf.is_file():
        convert(src, [(path, "f32", gguf)], root / "convert.log")
    monkeypatch.setenv("SPECDEC_HOME", str(root / "home"))  # the converted directory: a throwaway cache
    converted = hub.resolve_model(str(gguf), progress=False)
    assert json.loads((converted / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    got = load_mtp(converted, load_model_config(converted), torch.float32).state_dict()
    want = load_mtp(path, load_model_config(path), torch.float32).state_dict()
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert torch.equal(got[k], w), k
    llm = LLM(model=str(gguf), dtype="float32", progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, GREEDY)
    plain = llm.generate(PROMPTS, GREEDY, num_speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert 0 < sum(o.metrics.num_accepted_tokens for o in outs) < sum(o.metrics.num_draft_tokens for o in outs)
