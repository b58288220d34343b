"""Tokenizer, chat template and streaming detokenization."""
from __future__ import annotations

import json
import shutil

import pytest

from specdec.errors import SpecdecError
from specdec.formats.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["Hello world! Ünïcödé ✓ 你好 🙂", "def fibonacci(n):\n    return n\n", "🙂🙂 ✓✓ 你好你好 é", "plain"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:  # tiny_model_dir: tests/conftest.py (a byte-level BPE)
    return Tokenizer(tiny_model_dir)


def test_encode_decode_round_trip(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("plain", add_special_tokens=False) == tok.encode("plain")  # no BOS here


def test_eos_ids_and_special_tokens(tok):
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert tok.encode("<|im_start|>") == [tok.hf.convert_tokens_to_ids("<|im_start|>")]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"  # special tokens skipped


def test_chat_template(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello world"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(SpecdecError, match="list of"):
        tok.apply_chat_template([{"text": "no role"}])


def test_no_chat_template_is_a_clear_error(tiny_model_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(plain)
    assert not t.has_chat_template
    with pytest.raises(SpecdecError, match="has no chat template") as e:
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdecError, match="could not load a tokenizer"):
        Tokenizer(tmp_path)


def stream(tok: Tokenizer, ids: list[int], step: int = 1, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    deltas = [detok.feed(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenizer_never_splits_characters(tok, step):
    for text in TEXTS:
        ids = tok.encode(text)
        deltas = stream(tok, ids, step)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
    multi = tok.encode("🙂")
    assert len(multi) > 1  # the tiny vocabulary spells the emoji in bytes: a real test
    assert stream(tok, multi)[:len(multi) - 1] == [""] * (len(multi) - 1)


def test_incremental_detokenizer_with_prompt_context_and_specials(tok):
    prompt = tok.encode("Hello")
    ids = tok.encode(" world<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(detok.feed([i]) for i in ids) + detok.flush() == " world"


def test_flush_emits_a_dangling_partial_character(tok):
    ids = tok.encode("a🙂")
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[:1]) == "a"
    assert detok.feed(ids[1:-1]) == ""  # the emoji is not complete yet
    assert detok.flush() == "\ufffd"


@pytest.mark.real
def test_real_tokenizers():
    from specdec.formats.hub import resolve_model

    smol = Tokenizer(resolve_model("smollm2-135m", progress=False))
    assert smol.encode("Hello world") == [19556, 905]
    assert smol.eos_token_ids == {2}
    assert smol.hf.convert_ids_to_tokens(smol.encode("In 2024")) == ["In", "Ġ", "2", "0", "2", "4"]
    chat = smol.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0] == 1 and smol.decode(chat[-4:], skip_special_tokens=False) == "<|im_start|>assistant\n"
    qwen = Tokenizer(resolve_model("qwen2.5-coder-0.5b", progress=False))
    assert qwen.encode("<|im_start|>user") == [151644, 872]
    assert qwen.eos_token_ids == {151645, 151643}
    assert qwen.encode("def fibonacci(n):") == [750, 75698, 1445, 1648]
    text = "print('héllo 你好 🙂')"
    ids = qwen.encode(text)
    assert "".join(stream(qwen, ids)) == text


def _with_template(tiny_model_dir, tmp_path, template: str) -> Tokenizer:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return Tokenizer(d)


def test_chat_template_kwargs_reach_the_template(tiny_model_dir, tmp_path):
    """Qwen3's switch: ``enable_thinking`` passed through (LLM.chat's and the server's chat_template_kwargs)."""
    tok = _with_template(tiny_model_dir, tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<|im_start|>{% endif %}")
    msgs = [{"role": "user", "content": "Hello"}]
    on, off = tok.apply_chat_template(msgs), tok.apply_chat_template(msgs, template_kwargs={"enable_thinking": False})
    assert off[:len(on)] == on and off[len(on):] == [tok.hf.convert_tokens_to_ids("<|im_start|>")]
    with pytest.raises(SpecdecError, match="chat_template_kwargs"):
        tok.apply_chat_template(msgs, template_kwargs={"add_generation_prompt": False})


def test_the_templates_end_of_turn_token_stops_a_reply(tiny_model_dir, tmp_path):
    """A template ending turns with a marker the config does not name as EOS (Gemma's <end_of_turn>,
    Llama 3's <|eot_id|>): the marker stops generation too."""
    tok = _with_template(tiny_model_dir, tmp_path, "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    plain = _with_template(tiny_model_dir, tmp_path / "b", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert plain.eos_token_ids <= tok.eos_token_ids
