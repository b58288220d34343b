"""The data stage of `specdec train eagle` / `train medusa`: the token budget, the held-out split,
and held-out prompts for the final evaluation even when the budget is small."""
import argparse
import json

from conftest import CORPUS, make_model_dir
from specdec.formats.tokenizer import Tokenizer
from specdec.train.data import held_out, iter_source
from specdec.train.extract import Corpus
from specdec.train.pipeline import prepare_data, usable


def test_a_small_budget_still_holds_out_the_prompts_the_final_evaluation_needs(tmp_path):
    target = make_model_dir(tmp_path / "t", layers=1, hidden=32)
    data = tmp_path / "data.jsonl"
    records = [{"id": f"r{i}", "text": f"{CORPUS[i % len(CORPUS)]} {i}"} for i in range(3000)]
    for i in range(0, 3000, 2):  # half of them conversations opened by the assistant: nothing to ask
        records[i] = {"id": f"r{i}", "messages": [{"role": "assistant", "content": "hello"},
                                                  {"role": "user", "content": "hi"}]}
    data.write_text("\n".join(json.dumps(r) for r in records))
    a = argparse.Namespace(model=str(target), data=[str(data)], max_tokens=200, max_seq_len=64, heldout_per_mille=5,
                           final_eval_prompts=4)
    (tmp_path / "out").mkdir()
    prepare_data(a, Tokenizer(target), tmp_path / "out")
    info = json.loads((tmp_path / "out" / "data.json").read_text())
    held = info["heldout_ids"]
    # the budget was spent within the first records; the source was read on for 4 held-out prompts
    assert len(held) == 4 and 200 <= info["tokens"] < 400
    assert info["sources"][0]["heldout"] == 4
    assert all(held_out(h, 5) for h in held)
    prompts = [json.loads(x) for x in (tmp_path / "out" / "eval_prompts.jsonl").read_text().splitlines()]
    assert [p["id"] for p in prompts] == held and all(p.get("prompt") for p in prompts)
    assert all(usable(p) for p in prompts) and not usable({"id": "x", "messages": [{"role": "user", "content": " "}]})
    assert len(Corpus.load(tmp_path / "out" / "corpus.safetensors")) == info["sequences"]


def test_stdlib_is_the_standard_library_without_installed_packages():
    ids = [r.id for r, _ in zip(iter_source("stdlib", None), range(100_000))]
    assert any(i.endswith("os.py") for i in ids)
    assert not any("site-packages" in i or "dist-packages" in i for i in ids)


def test_regenerate_trains_on_the_targets_own_replies_and_resumes_without_regenerating(tmp_path, monkeypatch):
    from specdec import LLM, SamplingParams
    from specdec.train import regenerate
    from specdec.train.data import Record, tokenize

    target = make_model_dir(tmp_path / "t", layers=1, hidden=32)
    data = tmp_path / "data.jsonl"
    recs = [{"id": f"c{i}", "messages": [{"role": "user", "content": CORPUS[i % len(CORPUS)]},
                                         {"role": "assistant", "content": "someone else's reply " * 4}]}
            for i in range(5)] + [{"id": "t0", "text": CORPUS[0] * 3}]
    data.write_text("\n".join(json.dumps(r) for r in recs))
    a = argparse.Namespace(model=str(target), data=[str(data)], max_tokens=None, max_seq_len=256, heldout_per_mille=0,
                           final_eval_prompts=0, quantization=None, regenerate=True, regen_max_tokens=6, regen_batch=2)
    out = tmp_path / "out"
    out.mkdir()
    tok = Tokenizer(target)
    prepare_data(a, tok, out)
    llm = LLM(model=str(target), progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    want = []
    for r in recs[:5]:
        ask = r["messages"][:1]
        reply = llm.chat(ask, greedy)[0].outputs[0].text
        want.append(tokenize(Record(r["id"], "x", messages=ask + [{"role": "assistant", "content": reply}]), tok, 256))
    want.append(tokenize(Record("t0", "x", text=recs[5]["text"]), tok, 256))
    got = Corpus.load(out / "corpus.safetensors")
    assert sorted(tuple(got.seq(i)) for i in range(len(got))) == sorted(map(tuple, want))  # replies: the target's; text: as is
    info = json.loads((out / "data.json").read_text())
    assert info["sources"][0]["regenerated"] == 5
    cached = [json.loads(x) for x in (out / regenerate.FILE).read_text().splitlines()]
    assert sorted(c["id"] for c in cached) == [f"data.jsonl:c{i}" for i in range(5)]
    # a rerun (the corpus lost, an interrupted line at the end) reuses every reply: no model is loaded
    (out / "corpus.safetensors").unlink()
    with (out / regenerate.FILE).open("a") as f:
        f.write('{"id": "c9", "rep')
    monkeypatch.setattr(regenerate.Regenerator, "_llm", lambda self: 1 / 0)
    prepare_data(a, tok, out)
    assert sorted(tuple(c.seq(i)) for c in [Corpus.load(out / "corpus.safetensors")] for i in range(len(c))) == sorted(map(tuple, want))


def test_each_checkpoints_evaluation_reads_the_head_then_on_disk(tmp_path):
    """The evaluation at each checkpoint reuses one LLM; the head rewritten under the same path must be
    read again (it was not: every checkpoint measured the first one's head)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from conftest import make_eagle_head_dir
    from specdec.train.pipeline import evaluate

    target = make_model_dir(tmp_path / "t", layers=2, hidden=64)
    first, second = (make_eagle_head_dir(tmp_path / n, target, seed=s) for n, s in (("a", 0), ("b", 1)))
    head = tmp_path / "head"
    shutil.copytree(first, head)
    box: dict = {}
    prompts = [{"id": "p", "prompt": "def fibonacci(n):"}]
    evaluate(str(target), head, prompts, 8, 3, None, box)
    fc = box["llm"].proposer.head.fc  # a Linear on the native tiles where they are built, else nn.Linear
    before = (fc.dense_weight() if hasattr(fc, "dense_weight") else fc.weight).clone()
    shutil.copytree(second, head, dirs_exist_ok=True)  # the next checkpoint, exported under the same path
    res = evaluate(str(target), head, prompts, 8, 3, None, box)
    fc = box["llm"].proposer.head.fc
    now = fc.dense_weight() if hasattr(fc, "dense_weight") else fc.weight
    want = load_file(str(second / "model.safetensors"))["fc.weight"].to(now.dtype)
    assert not torch.equal(before, now) and torch.equal(now, want)
    assert res["eval_tokens"] == 8
