"""Shared fixtures: a tiny random-weight model directory with a real (tiny) BPE tokenizer; how the run
spreads over the cores (pytest-xdist: ``-n auto`` in pyproject's addopts)."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

# Under pytest-xdist each worker gets its share of the cores as OpenMP threads (PyTorch's and the native
# kernels'), set before either starts its pool: spinning OpenMP barriers on more threads than cores stall.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _workers))

import pytest  # noqa: E402
import torch  # noqa: E402

# SPECDEC_TEST_DEVICE=cuda: every LLM the tests build without naming a device runs there, so the
# losslessness suite and the distribution tests check the CUDA path as they check the CPU one
# (`SPECDEC_TEST_DEVICE=cuda pytest tests/proposers/test_lossless_suite.py ...` on a GPU machine).
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
if TEST_DEVICE != "cpu":
    import specdec.llm  # noqa: E402

    _llm_init = specdec.llm.LLM.__init__

    def _init_on_test_device(self, *args, **kwargs):
        if len(args) < 3:  # (model, dtype, device): a device given by position wins
            kwargs.setdefault("device", TEST_DEVICE)
        _llm_init(self, *args, **kwargs)

    specdec.llm.LLM.__init__ = _init_on_test_device


CPU_ONLY = ("int4", "cascade-self", "quantized")  # in a test's name: int4 weights (the self-drafts' too), CPU only


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """The ``(1, T, V)`` logits of one whole sequence, uncached, on the CPU whatever device the model is on."""
    dev = model.embed_tokens.weight.device
    with torch.inference_mode():
        return model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                     model.new_cache(1, len(ids) + 1)).logits.cpu()


MAX_WORKERS = 4  # each worker may hold the real models of a test module: bounded for memory
SERIAL_GROUPS = {"ray": ("test_cluster", "test_playground.py")}  # local Ray clusters: one worker runs them all


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the group marks to suffix the ids
def pytest_collection_modifyitems(config, items) -> None:
    """Tests that start a local Ray cluster run in one worker, one after another (``--dist loadgroup``);
    the tests on real models (minutes each on one core) go first, so that the workers share them out
    from the start and the run does not end on one of them with the other cores idle; under
    SPECDEC_TEST_DEVICE the int4 tests skip (CPU only)."""
    for item in items:
        for group, names in SERIAL_GROUPS.items():
            if item.path.name.startswith(names):
                item.add_marker(pytest.mark.xdist_group(group))
        if TEST_DEVICE != "cpu" and any(word in item.name for word in CPU_ONLY):
            item.add_marker(pytest.mark.skip(reason=f"int4 quantization runs on the CPU only, not {TEST_DEVICE}"))
    items.sort(key=lambda item: item.get_closest_marker("real") is None)  # stable: the rest keep their order

# a file: each test's start and end, as the run goes; the controller writes it (it hears every worker)
_LOG = None if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("SPECDEC_TEST_LOG")
_T0 = time.monotonic()


def _log(line: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{time.monotonic() - _T0:7.0f}s {line}\n")


def pytest_runtest_logstart(nodeid, location) -> None:
    """Where a run that a time limit ended spent its time (CI prints the log then)."""
    _log(f"start {nodeid}")


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed" or report.duration > 5:
        _log(f"{report.when} {report.outcome} {report.duration:.1f}s {report.nodeid}")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.getcwd(), sys.argv)\n",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "Hello world! Ünïcödé ✓ 你好 🙂",
]


def make_tokenizer(out_dir: Path, vocab_size: int = 400) -> int:
    """Train a byte-level BPE tokenizer on a tiny corpus and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out_dir)
    return tok.get_vocab_size()


def make_model_dir(out_dir: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0,
                   arch: str = "llama", scale: float = 1.0, vocab_size: int = 400) -> Path:
    """A random-weight model directory loadable by specdec and by transformers (``vocab_size``: its
    tokenizer's, trained on the same corpus: another size gives another vocabulary)."""
    from safetensors.torch import save_file

    from specdec.config import ModelConfig
    from specdec.models.llama import build_model

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(out_dir, vocab_size)
    eos = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    eos_id = next(t["id"] for t in eos if t["content"] == "<|im_end|>")
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=False, attention_bias=arch == "qwen2",
                      architecture=arch, eos_token_ids=(eos_id,))
    model = build_model(cfg, dtype=torch.float32, seed=seed)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            kind = name.rsplit(".", 1)[1]
            q, k, v = t.split([cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                               cfg.num_key_value_heads * cfg.head_dim])
            base = name.removesuffix(f"qkv_proj.{kind}")
            sd.update({f"{base}q_proj.{kind}": q, f"{base}k_proj.{kind}": k, f"{base}v_proj.{kind}": v})
        elif name.endswith("gate_up_proj.weight"):
            g, u = t.split(cfg.intermediate_size)
            base = name.removesuffix("gate_up_proj.weight")
            sd.update({f"{base}gate_proj.weight": g, f"{base}up_proj.weight": u})
        else:
            sd[name] = t * (scale if name in ("lm_head.weight",) else 1.0)
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.contiguous() for k, v in sd.items()}
    save_file(sd, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf() | {"torch_dtype": "float32"}))
    return out_dir


# verification costs per T (seconds), roughly a dense bf16 model's on a CPU: nearly flat to 8 rows
SYNTHETIC_COSTS = {1: 1.0, 2: 1.01, 4: 1.05, 8: 1.2, 16: 1.55, 32: 2.6}


def synthetic_verify_costs(model, batch_size, sizes=None, repeats=None, context=0):
    """A tree's ``"tree_budget": "auto"`` (sizes not given) sees SYNTHETIC_COSTS; the cost-aware policy
    (``CostAwareK``, on for every target with drafts: it asks for the sizes 1 .. K + 1) sees blocks that
    get cheaper per row with T, so it always drafts the configured K, at any acceptance and length: the
    tests of speculation exercise speculation (random drafters' drafts mostly fail, and a real curve would
    turn them off), and tests/engine/test_budget.py drives the policy with curves of its own."""
    if sizes is None:
        return dict(SYNTHETIC_COSTS)
    return {t: 1.0 / t for t in sizes}


@pytest.fixture(autouse=True)
def _synthetic_verify_costs(monkeypatch):
    """Draft lengths chosen from measured verification costs see fixed curves in the tests, not timings:
    which K a test gets never depends on the machine's load (``synthetic_verify_costs``)."""
    from specdec.engine import budget

    monkeypatch.setattr(budget, "verify_costs", synthetic_verify_costs)


def make_pair(root: Path) -> tuple[Path, Path]:
    """The suites' target (4 layers, hidden 64) and draft (1 layer, hidden 32), one tokenizer."""
    return (make_model_dir(root / "t", layers=4, hidden=64, seed=0),
            make_model_dir(root / "d", layers=1, hidden=32, seed=3))


@pytest.fixture
def native_kernels():
    """The native kernels' library (``pytestmark = pytest.mark.usefixtures("native_kernels")`` in a module
    that needs them): skips without them, fails under SPECDEC_REQUIRE_KERNELS=1 (tests/native_util.py)."""
    from native_util import require_native  # noqa: PLC0415
    return require_native()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model")


# every registered method, and the variants that draft differently (the quantized self-draft)
SUITE_VARIANTS = ["cascade", "cascade-self", "draft_model", "eagle", "layer_skip", "layer_skip-int4", "ngram"]
# token trees: EAGLE-2 dynamic trees from the draft model and the int4 self-draft, suffix trees
SUITE_VARIANTS += ["draft_model-tree", "layer_skip-int4-tree", "suffix", "medusa"]
# a draft model with another tokenizer (string-level greedy drafts, TLI at T > 0), and frequency-ranked
# draft heads (FR-Spec: draft_vocab_size) on the draft model and the int4 self-draft
SUITE_VARIANTS += ["draft_model-xvocab", "draft_model-fr", "layer_skip-int4-fr"]
# the target's own multi-token-prediction layers (random ones added to the suite's target: add_mtp_layers)
SUITE_VARIANTS += ["mtp"]
# the EAGLE head's tree: in the losslessness, distribution and constrained-output suites; not in the
# logprobs suite, whose acceptance check its untrained head's tree drafts (top-k of a random head) do
# not meet on its prompts (the draft model's tree covers tree verification's logprobs there)
EXTRA_TREES = ["eagle-tree"]
# methods that draft only for constrained requests (the grammar's forced tokens): their losslessness
# suites are tests/engine/test_structured.py and the constrained tests of test_distribution.py
CONSTRAINED_ONLY = ["grammar"]


def make_eagle_head_dir(out_dir: Path, target_dir: Path, seed: int = 0, draft_vocab: int | None = None) -> Path:
    """An untrained (random) EAGLE-3 head for the model in ``target_dir``, in speculators format:
    lossless whatever it drafts. Its draft vocabulary leaves out the last tenth of the ids, so the
    d2t / t2d mapping is exercised."""
    from specdec.heads.eagle import EagleConfig, EagleHead, init_head
    from specdec.formats.hf import load_model_config
    from specdec.heads.speculators import save_head

    if (out_dir / "config.json").is_file():
        return out_dir
    cfg = load_model_config(target_dir)
    n = cfg.num_hidden_layers
    ec = EagleConfig.for_target(cfg, draft_vocab or cfg.vocab_size * 9 // 10,
                                aux_layer_ids=(1, max(1, n // 2), n))
    head = init_head(EagleHead(ec), seed=seed)
    head.set_vocab(torch.arange(ec.draft_vocab_size))
    return save_head(out_dir, head, {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]},
                     dtype=torch.float32)


def add_mtp_layers(target_dir: Path, layers: int = 1, seed: int = 0) -> Path:
    """Random multi-token-prediction layers for the model in ``target_dir``, under GLM-4.5's checkpoint names
    (``model.layers.{N + i}``: enorm, hnorm, eh_proj, shared_head.norm and a decoder layer of the model's own
    kind), written beside its weights as ``mtp.safetensors``: the model's decoder leaves them, method mtp
    drafts with them (lossless whatever they draft)."""
    from safetensors.torch import save_file

    from specdec.formats.hf import load_model_config

    out = target_dir / "mtp.safetensors"
    if out.is_file():
        return target_dir
    cfg = load_model_config(target_dir)
    C, q, kv, inter = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                       cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.1) + (
            1.0 if len(shape) == 1 else 0.0)

    sd = {}
    for i in range(layers):
        p = f"model.layers.{cfg.num_hidden_layers + i}."
        sd.update({p + "enorm.weight": w(C), p + "hnorm.weight": w(C), p + "eh_proj.weight": w(C, 2 * C),
                   p + "shared_head.norm.weight": w(C), p + "input_layernorm.weight": w(C),
                   p + "post_attention_layernorm.weight": w(C), p + "self_attn.q_proj.weight": w(q, C),
                   p + "self_attn.k_proj.weight": w(kv, C), p + "self_attn.v_proj.weight": w(kv, C),
                   p + "self_attn.o_proj.weight": w(C, q), p + "mlp.gate_proj.weight": w(inter, C),
                   p + "mlp.up_proj.weight": w(inter, C), p + "mlp.down_proj.weight": w(C, inter)})
        if cfg.attention_bias:
            sd.update({p + f"self_attn.{n}_proj.bias": 0.1 * w(size) for n, size in (("q", q), ("k", kv), ("v", kv))})
    save_file(sd, str(out))
    return target_dir


def make_medusa_head_dir(out_dir: Path, target_dir: Path, seed: int = 0, num_heads: int = 3) -> Path:
    """Untrained (random) Medusa heads for the model in ``target_dir``, with the prior accuracies:
    lossless whatever they draft."""
    from specdec.formats.hf import load_model_config
    from specdec.heads.medusa import MedusaConfig, MedusaHeads, init_heads, save_heads

    if (out_dir / "config.json").is_file():
        return out_dir
    cfg = load_model_config(target_dir)
    mc = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads,
                      target=str(target_dir))
    return save_heads(out_dir, init_heads(MedusaHeads(mc), seed=seed, std=0.05), dtype=torch.float32)


def suite_target(draft_dir: Path) -> Path:
    """The target model directory beside ``draft_dir`` (the suites' make_pair / test models)."""
    return next(p for p in sorted(draft_dir.parent.iterdir())
                if p != draft_dir and (p / "config.json").is_file() and not p.name.endswith("-head"))


def spec_method_config(method: str, draft_dir: Path) -> dict:
    """A working speculative_config for every registered method and variant: the losslessness suites
    run over all of them, and a method missing here fails `test_every_registered_method_is_in_the_suite`.
    The eagle and medusa heads are made for the target beside ``draft_dir`` (the suites' targets: 4 layers,
    hidden 64, the draft's tokenizer)."""
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method in CONSTRAINED_ONLY:
        return {"method": method}
    if method == "eagle":
        head = make_eagle_head_dir(draft_dir.parent / "eagle-head", suite_target(draft_dir))
        return {"method": "eagle", "model": str(head)}
    if method == "eagle-tree":
        head = make_eagle_head_dir(draft_dir.parent / "eagle-head", suite_target(draft_dir))
        return {"method": "eagle", "model": str(head), "tree_topk": 3, "tree_depth": 3}
    if method == "draft_model-xvocab":  # the suite's target speaking a 300-token vocabulary, renumbered
        other = make_xvocab_dir(suite_target(draft_dir), draft_dir.parent / "xvocab-draft")
        return {"method": "draft_model", "model": str(other)}
    if method in ("draft_model-fr", "layer_skip-int4-fr"):  # a head of the 200 most frequent of 400 tokens
        corpus = draft_dir.parent / "corpus.txt"
        if not corpus.is_file():
            corpus.write_text("\n".join(CORPUS[:3]))
        fr = {"draft_vocab_size": 200, "draft_vocab_corpus": str(corpus)}
        base = spec_method_config(method.removesuffix("-fr"), draft_dir)
        return base | fr | ({"search_steps": 0} if method.startswith("layer_skip") else {})
    if method == "mtp":
        add_mtp_layers(suite_target(draft_dir))
        return {"method": "mtp"}
    if method == "medusa":
        head = make_medusa_head_dir(draft_dir.parent / "medusa-head", suite_target(draft_dir))
        return {"method": "medusa", "model": str(head)}
    return {
        "draft_model": {"method": "draft_model", "model": str(draft_dir)},
        "ngram": ngram,
        "draft_model-tree": {"method": "draft_model", "model": str(draft_dir), "tree_topk": 3, "tree_depth": 3},
        "layer_skip-int4-tree": {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0,
                                 "search_steps": 0, "draft_confidence_threshold": 0.0, "tree_topk": 2,
                                 "tree_depth": 4},
        "suffix": {"method": "suffix", "suffix_factor": 4.0},
        "layer_skip": {"method": "layer_skip", "skip_ratio": 0.5, "search_steps": 8,
                       "draft_confidence_threshold": 0.0},
        # the target's own weights at 4 bits, every layer at first; the search may skip some
        "layer_skip-int4": {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0,
                            "search_steps": 8, "draft_confidence_threshold": 0.0},
        "cascade": {"method": "cascade", "stages": [ngram | {"num_speculative_tokens": 2},
                                                    {"method": "draft_model", "model": str(draft_dir)}]},
        # n-gram -> the target's own weights at 4 bits (in the target's cache) -> the target
        "cascade-self": {"method": "cascade-self", "stage_tokens": 2, "prompt_lookup_max": 3},
    }[method]


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of the module's ``server`` (a ``server_util.ServerProcess``)."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0) as c:
        yield c


def make_xvocab_dir(target_dir: Path, out_dir: Path, vocab_size: int | None = 300, seed: int = 1) -> Path:
    """The model of ``target_dir`` speaking another vocabulary: a tokenizer trained to ``vocab_size``
    tokens (None: the target's own), its ordinary tokens' ids shuffled, and the embedding and LM head
    rows of each token taken from the target's token with the same string (every layer the target's).
    A drafter of another tokenizer that agrees with the target where their tokenizations do."""
    import shutil

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "config.json").is_file():
        return out_dir
    if vocab_size is None:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (target_dir / f).is_file():
                shutil.copy(target_dir / f, out_dir / f)
    else:
        make_tokenizer(out_dir, vocab_size)
    tj = json.loads((out_dir / "tokenizer.json").read_text())
    added = {t["id"]: t["content"] for t in tj["added_tokens"]}
    vocab = tj["model"]["vocab"]
    ids = sorted(i for i in vocab.values() if i not in added)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    new_id = {old: ids[p] for old, p in zip(ids, perm)}
    tj["model"]["vocab"] = vocab = {tok: new_id.get(i, i) for tok, i in vocab.items()}
    (out_dir / "tokenizer.json").write_text(json.dumps(tj))
    target_tj = json.loads((target_dir / "tokenizer.json").read_text())
    target_id = dict(target_tj["model"]["vocab"]) | {t["content"]: t["id"] for t in target_tj["added_tokens"]}
    strings = {i: tok for tok, i in vocab.items()} | added  # draft id -> its string
    n = len(strings)
    rows = torch.tensor([target_id[strings[i]] for i in range(n)])  # every draft string is a target token
    sd = load_file(str(target_dir / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        sd[name] = sd[name][rows].contiguous()
    save_file(sd, str(out_dir / "model.safetensors"))
    cfg = json.loads((target_dir / "config.json").read_text())
    eos = next(i for i, c in added.items() if c == "<|im_end|>")
    (out_dir / "config.json").write_text(json.dumps(cfg | {"vocab_size": n, "eos_token_id": eos}))
    return out_dir


def assert_same_tokenizer(ours, ref) -> None:
    """``ours`` and ``ref`` (transformers tokenizers) cut and mend every text alike (tests/formats/test_gguf_in_place.py, tests/test_real_models.py)."""
    texts = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
             "Héllo wörld ✓ 你好 🙂🚀", "", " ", "  two leading", "x" + " " * 40 + "y", "\n\n\tindented",
             "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> after a special"]
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.bos_token_id,
                                                                         ref.pad_token_id)
    assert len(ours) == len(ref) and ours.chat_template == ref.chat_template
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
