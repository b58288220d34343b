"""The data stage of `specdec train eagle` / `train medusa`: the token budget, the held-out split,
and held-out prompts for the final evaluation even when the budget is small."""
import argparse
import json

from conftest import CORPUS, make_model_dir
from specdec.models.tokenizer import Tokenizer
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
