"""The native forward on the mixture-of-experts families (kernels/csrc/moe.c; gpt-oss with its attention
sinks, biases and clamped SwiGLU too; GLM-4.5 with its grouped sigmoid router, correction bias, routed scale
and ungated shared expert): close to the PyTorch reference, and bit for bit what exact
speculation rests on, in bf16 and int4: a block of K tokens scores like K one-token steps, tree branches
like their chains, a row like itself beside rows routed to other experts, any number of threads; and
each chosen expert's weights are read once per forward (its products run over all the rows that chose
it together). The bit-for-bit checks are test_native_families' own, run on these families."""
from __future__ import annotations

import pytest
import torch

import test_native_families as dense
from family_util import MOE_CONFIGS, WINDOW, family_config
from glm_util import glm_config
from native_util import reference_and_native
from specdec.models import native
from specdec.models.moe import MoE

pytestmark = pytest.mark.usefixtures("native_kernels")
NATIVE = [*MOE_CONFIGS, "glm4_moe"]
QUANTS = [None, "int4"]


def config(name: str):
    """The family's tiny config; GLM-4.5's (tests/glm_util.py: 8 experts in 4 groups of which 2 compete) with
    heads of 32, so that its half-rotary heads rotate 16 dimensions (what the native forward runs)."""
    return glm_config(head_dim=32) if name == "glm4_moe" else family_config(name)


def pair(name: str, quant: str | None = None):
    return reference_and_native(config(name), quant)


@pytest.fixture
def quantized_pairs(monkeypatch):
    """test_native_families' checks on a quantized pair: its ``pair`` builds them with ``quant``."""
    def use(quant):
        monkeypatch.setattr(dense, "pair", lambda name, _=None: pair(name, quant))
    return use


def routing_counts(model, L: int, E: int) -> tuple[torch.Tensor, list]:
    """(rows routed to each expert of each layer, the hooks' handles) by the reference's MoE layers."""
    counts = torch.zeros(L, E, dtype=torch.int64)
    handles = []
    for i, blk in enumerate(model.layers):
        if isinstance(blk.mlp, MoE):
            def hook(mod, args, out, i=i):
                idx = mod.select(args[0].reshape(-1, args[0].shape[-1]))[0]
                counts[i] += torch.bincount(idx.reshape(-1), minlength=E)
            handles.append(blk.mlp.register_forward_hook(hook))
    return counts, handles


def moe_layers(cfg) -> int:
    return sum(map(cfg.is_moe, range(cfg.num_hidden_layers)))


def stats_on(m) -> torch.Tensor:
    """Zeroed per-expert counters the native forward adds to from now on (``NativeForward.moe_stats``)."""
    cfg = m.config
    m.native.moe_stats = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, 3, dtype=torch.int64)
    return m.native.moe_stats


def test_what_the_native_forward_lacks_is_said():
    assert all(not native.missing_features(config(f)) for f in NATIVE)


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("quant", QUANTS)
def test_native_logits_agree_with_the_reference(name, quant):
    """As close as the dense families' (test_native_families) where both paths route a token alike. The
    router's product is the same on both paths, but its input differs in the last bits (sums in another
    order), so a near-tie between the k-th and the next expert may go the other way on a few tokens of a
    few layers, which moves those tokens' logits further: most tokens must stay within the dense bound,
    and the two paths must route almost every (token, layer) alike."""
    ref, nat = pair(name, quant)
    cfg = ref.config
    toks = torch.randint(0, 97, (2, 2 * WINDOW + 6), generator=torch.Generator().manual_seed(1))
    n = toks.shape[1]
    counts, handles = routing_counts(ref, cfg.num_hidden_layers, cfg.num_experts)
    outs = []
    for m in (ref, nat):
        cache = m.new_cache(2, 64)
        with torch.inference_mode():
            m(toks[:, :n - 6], torch.arange(n - 6).expand(2, -1), cache, fused_attention=True)
            if m is ref:
                counts.zero_()
            else:
                stats = stats_on(nat)
            outs.append(m(toks[:, n - 6:], torch.arange(n - 6, n).expand(2, -1), cache).logits.float())
    for h in handles:
        h.remove()
    a, b = outs
    err = (a - b).abs().amax(-1) / a.abs().max()  # per token
    assert (err < (0.03 if quant is None else 0.05)).float().mean() >= 0.75, err
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    routed = stats[..., 0]
    assert int(routed.sum()) == int(counts.sum()) == 12 * cfg.experts_per_tok * moe_layers(cfg)
    assert int((routed - counts).abs().sum()) <= 0.1 * int(counts.sum())


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("quant", QUANTS)
def test_blocks_of_any_size_score_exactly_like_one_token_steps(name, quant, quantized_pairs):
    quantized_pairs(quant)
    dense.test_blocks_of_any_size_score_exactly_like_one_token_steps(name)


@pytest.mark.parametrize("name,quant", [("mixtral", None), ("qwen2_moe", "int4")])
def test_tree_branches_score_exactly_like_their_chains(name, quant, quantized_pairs):
    quantized_pairs(quant)
    dense.test_tree_branches_score_exactly_like_their_chains(name)


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("quant", QUANTS)
def test_results_do_not_depend_on_the_number_of_threads(name, quant, quantized_pairs):
    quantized_pairs(quant)
    dense.test_results_do_not_depend_on_the_number_of_threads(name)


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("quant", QUANTS)
def test_a_row_scores_alike_beside_rows_routed_to_other_experts(name, quant):
    """Row 0's step alone and beside 3 rows that share some of its experts (their products then run
    over several rows, row 0 among them, at another place) and take others: the same bits."""
    _, m = pair(name, quant)
    cfg = m.config
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, 97, (4, 20), generator=g)
    step = torch.randint(0, 97, (4, 1), generator=g)
    outs, used = [], []
    for rows in (1, 4):
        cache = m.new_cache(4, 64)
        with torch.inference_mode():
            m(prompts[:rows], torch.arange(20).expand(rows, -1), cache)
            stats = stats_on(m)
            outs.append(m(step[:rows], torch.full((rows, 1), 20), cache).logits[0])
        used.append(stats[..., 0].clone())
    assert torch.equal(outs[0], outs[1])
    alone, beside = used
    # in some layer an expert of row 0 also ran other rows, and the others took an expert row 0 did not
    assert bool(((alone > 0) & (beside > alone)).any())
    assert bool(((alone == 0) & (beside > 0)).any())
    assert int(beside.sum()) == 4 * int(alone.sum()) == 4 * cfg.experts_per_tok * moe_layers(cfg)


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("quant", QUANTS)
def test_each_chosen_expert_is_read_once_per_forward(name, quant):
    """The expert products are grouped by expert over the block's rows: in a forward of 16 rows, every
    tile of a chosen expert's gate/up and down products is computed once, however many rows chose it,
    and an expert no row chose is not read at all."""
    _, m = pair(name, quant)
    cfg = m.config
    toks = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    cache = m.new_cache(2, 64)
    with torch.inference_mode():
        m(toks[:, :16], torch.arange(16).expand(2, -1), cache)
        stats = stats_on(m)
        m(toks[:, 16:], torch.arange(16, 24).expand(2, -1), cache)
    rows, gate_up, down = stats.unbind(-1)
    moe = torch.tensor([cfg.is_moe(i) for i in range(cfg.num_hidden_layers)])
    assert torch.equal(rows.sum(-1), moe * 16 * cfg.experts_per_tok)
    chosen = rows > 0
    assert torch.equal(gate_up, chosen * (2 * cfg.moe_intermediate_size // 16))
    assert torch.equal(down, chosen * (cfg.hidden_size // 16))
    assert int(rows.max()) > 1  # an expert shared by several rows still ran once
