"""Reading a GGUF file fast: our reader subclass parses what gguf's own does, and the tokenizer built
with the model type we already know is the one AutoTokenizer builds after parsing the file again."""
from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import pytest

from specdec.formats.gguf_file import config_from_gguf, open_gguf, write_tokenizer_from_gguf
from test_loading import make_hf_weights, write_gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_our_reader_reads_what_ggufs_reader_does(tmp_path, arch):
    """gguf_reader.GGUFFile (what open_gguf gives): every metadata value, tensor, type, shape, offset and
    byte as the gguf package's own reader has them (its virtual GGUF.* header fields aside)."""
    import gguf

    path = write_gguf(tmp_path / "m.gguf", arch, make_hf_weights(arch))
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key in ours.fields:
        assert ours.get_field(key).contents() == theirs.get_field(key).contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.data_offset == b.data_offset and a.tensor_type == b.tensor_type and a.n_bytes == b.n_bytes
        assert list(a.shape) == list(b.shape) and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert Path(ours.path) == path  # write_safetensors_from_gguf reads the blocks from this file


def test_a_vocabularys_strings_are_found_without_decoding_them_all(tmp_path):
    """The config needs a few end-of-turn tokens' ids of a 152k-string vocabulary: found by one walk over the
    strings' lengths (Qwen2.5's config 0.10 -> 0.017 s), the same ids ``list.index`` gives, absent ones left out."""
    path = write_gguf(tmp_path / "m.gguf", "qwen2", make_hf_weights("qwen2"))
    field = open_gguf(path).get_field("tokenizer.ggml.tokens")
    tokens = field.contents()
    assert field.count() == len(tokens) > 100
    want = [tokens[0], tokens[7], tokens[-1], tokens[len(tokens) // 2], "<no such token>"]
    assert field.string_indexes(want) == {t: tokens.index(t) for t in want if t in tokens}
    assert field.string_indexes([]) == {}
    with pytest.raises(ValueError):
        open_gguf(path).get_field("general.architecture").string_indexes(["x"])


def test_a_truncated_or_foreign_file_is_one_clear_error(tmp_path):
    from specdec.errors import SpecdecError

    path = write_gguf(tmp_path / "m.gguf", "llama", make_hf_weights("llama"))
    data = path.read_bytes()
    for name, body in (("cut.gguf", data[: len(data) // 2]), ("head.gguf", data[:40]), ("empty.gguf", b""),
                       ("text.gguf", b"not a model at all" * 10)):
        bad = tmp_path / name
        bad.write_bytes(body)
        with pytest.raises(SpecdecError, match="not a valid GGUF file"):
            open_gguf(bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_tokenizer_built_from_the_model_type_is_autotokenizers(tmp_path, arch):
    path = write_gguf(tmp_path / "m.gguf", arch, make_hf_weights(arch))
    reader = open_gguf(path)
    model_type = config_from_gguf(reader, path).to_hf()["model_type"]
    fast, auto = tmp_path / "fast", tmp_path / "auto"
    fast.mkdir()
    auto.mkdir()
    write_tokenizer_from_gguf(path, fast, "smollm" if arch == "llama" else "qwen2", model_type=model_type)
    write_tokenizer_from_gguf(path, auto, "smollm" if arch == "llama" else "qwen2")  # AutoTokenizer's own way
    names = sorted(p.name for p in auto.iterdir())
    assert names == sorted(p.name for p in fast.iterdir()) and "tokenizer.json" in names
    for name in names:
        assert filecmp.cmp(fast / name, auto / name, shallow=False), name
