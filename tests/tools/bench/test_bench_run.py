"""`specdec bench` end to end on tiny random-weight models: results.json, plots, the identity check
(and its failure), and the transformers peer."""
from __future__ import annotations

import json

import pytest

from conftest import make_model_dir
from specdec.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = make_model_dir(root / "target", layers=2, seed=0)
    draft = make_model_dir(root / "draft", layers=1, seed=0)  # same tokenizer, fewer layers
    return target, draft


@pytest.fixture()
def prompt_file(tmp_path):
    p = tmp_path / "q.jsonl"
    recs = [{"question_id": 1, "category": "coding", "turns": ["def fibonacci(n):", "import os"]},
            {"question_id": 2, "category": "qa", "turns": ["The capital of France is"]},
            {"question_id": 3, "category": "qa", "turns": ["Hello world!"]},
            {"category": "code", "prompt": "for i in range(10):"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def bench(models, prompts, out, *extra):
    target, draft = models
    return main(["bench", "--model", str(target), "--speculative-model", str(draft), "--prompts", str(prompts),
                 "--max-tokens", "12", "--dtype", "float32", "--output", str(out), "--no-progress", *extra])


def valid_png(path) -> bool:
    from PIL import Image
    with Image.open(path) as im:
        im.verify()
    return path.read_bytes()[:8] == PNG


def test_sweep_writes_records_summaries_and_plots(models, prompt_file, tmp_path, capsys):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    rc = bench(models, prompt_file, out, "--num-speculative-tokens", "1", "3", "--all-turns",
               "--plots", str(plots))
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    doc = json.loads(out.read_text())
    assert doc["identity_check"] == "passed" and doc["mismatches"] == 0
    assert doc["command"].startswith("specdec bench --model") and doc["args"]["max_tokens"] == 12
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["torch"]
    configs = ["plain", "draft_model K=1", "draft_model K=3"]
    assert len(doc["records"]) == 4 * len(configs)
    for r in doc["records"]:
        assert r["identical_to_plain"] is True and r["num_tokens"] == len(r["token_ids"]) > 0
        assert set(r["metrics"]) >= {"draft_seconds", "verify_seconds", "other_seconds", "acceptance_by_position"}
    multi = [r for r in doc["records"] if r["question_id"] == "1"]
    assert all(len(r["texts"]) == 2 and r["category"] == "mt-bench" for r in multi)  # both turns ran
    s = doc["summary"]
    for cat in ("mt-bench", "qa", "code", "overall"):
        for c in configs:
            v = s[f"{cat}|{c}"]
            assert v["tokens_per_second"] > 0 and v["speedup"] > 0 and v["mismatches"] == 0
    k3 = s["overall|draft_model K=3"]
    assert k3["k"] == 3 and 1.0 <= k3["mean_accepted_length"] <= 4.0 and len(k3["acceptance_by_position"]) == 3
    assert s["overall|plain"]["speedup"] == pytest.approx(1.0)
    assert "| engine | config | mt-bench | qa | code | overall |" in doc["markdown"]
    assert "identical to plain" in stdout and "MISMATCH" not in stdout
    names = {p.name for p in plots.iterdir()}
    assert names == {"speedup_by_category.png", "acceptance_by_position.png", "speedup_vs_k.png"}
    assert all(valid_png(plots / n) for n in names)


def test_mismatch_is_reported_and_exits_nonzero(models, prompt_file, tmp_path, capsys, monkeypatch):
    import specdec.engine.step as engine
    real = engine.verify_greedy

    def broken(draft_ids, logits, num_draft):  # corrupt the first emitted token of speculative steps only
        out, n = real(draft_ids, logits, num_draft)
        if draft_ids.shape[1]:
            out = out.clone()
            out[:, 0] = (out[:, 0] + 1) % logits.shape[-1]
        return out, n

    monkeypatch.setattr(engine, "verify_greedy", broken)
    out = tmp_path / "r.json"
    rc = bench(models, prompt_file, out, "--num-speculative-tokens", "2", "--limit", "1")
    captured = capsys.readouterr()
    assert rc == 1
    doc = json.loads(out.read_text())
    assert doc["identity_check"] == "FAILED" and doc["mismatches"] > 0
    assert doc["summary"]["overall|draft_model K=2"]["mismatches"] > 0
    assert any("ERROR" in n for n in doc["notes"])
    assert "MISMATCH" in captured.out and "ERROR" in captured.out


def test_sampled_run_skips_identity_check(models, prompt_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench(models, prompt_file, out, "--speculative-method", "draft_model", "ngram",
               "--temperature", "0.8", "--categories", "qa", "--limit", "1")
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["identity_check"].startswith("skipped")
    assert all(r["identical_to_plain"] is None for r in doc["records"])
    assert {r["config"] for r in doc["records"]} == {"plain", "draft_model K=5", "ngram K=5"}
    assert "identity check skipped" in capsys.readouterr().out


def test_peer_hf_runs_transformers_assisted_generation(models, prompt_file, tmp_path, capsys):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    rc = bench(models, prompt_file, out, "--speculative-method", "draft_model", "ngram", "cascade",
               "--num-speculative-tokens", "2", "--peer", "hf", "--limit", "1", "--plots", str(plots))
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    doc = json.loads(out.read_text())
    hf = {r["config"] for r in doc["records"] if r["engine"] == "hf"}
    assert hf == {"hf plain", "hf draft_model K=2", "hf ngram K=2"}
    assert any("cascade" in n and "not run" in n for n in doc["notes"])
    assert any(n.startswith("peer check: transformers' plain greedy output equals ours") for n in doc["notes"])
    s = doc["summary"]
    for name in ("hf draft_model K=2", "hf ngram K=2"):
        v = s[f"overall|{name}"]
        assert v["engine"] == "hf" and v["tokens_per_second"] > 0
        assert v["speedup"] > 0 and v["speedup_vs_specdec_plain"] > 0 and v["mean_accepted_length"] >= 1.0
        assert v["specdec_config"] == name.removeprefix("hf ")
    assert s["overall|hf plain"]["speedup"] == pytest.approx(1.0)
    assert "transformers" in stdout and "transformers" in doc["markdown"]
    assert valid_png(plots / "speedup_by_category.png")


def test_tree_topk_sweep_puts_a_chain_beside_trees_in_one_run(models, prompt_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench(models, prompt_file, out, "--num-speculative-tokens", "4", "--tree-topk", "0", "2",
               "--speculative-method", "draft_model", "ngram", "--limit", "1")
    assert rc == 0
    recs = json.loads(out.read_text())["records"]
    names = sorted({r["config"] for r in recs})
    assert names == ["draft_model K=4 chain", "draft_model K=4 tree top-2", "ngram K=4", "plain"]
    tree = [r for r in recs if r["config"] == "draft_model K=4 tree top-2"]
    assert tree and all(r["identical_to_plain"] for r in recs if r["method"] != "plain")


def test_method_option_gives_one_method_its_own_model_beside_the_shared_flag(models, prompt_file, tmp_path):
    from conftest import make_eagle_head_dir
    target, _ = models
    head = make_eagle_head_dir(tmp_path / "eagle-head", target)
    out = tmp_path / "r.json"
    rc = bench(models, prompt_file, out, "--num-speculative-tokens", "3", "--speculative-method", "draft_model",
               "eagle", "--method-option", f"eagle.model={head}", "--method-option", "eagle.tree_topk=2",
               "--limit", "1", "--categories", "qa")
    assert rc == 0
    recs = json.loads(out.read_text())["records"]
    assert {r["config"] for r in recs} == {"plain", "draft_model K=3", "eagle K=3 tree top-2"}
    assert all(r["identical_to_plain"] for r in recs if r["method"] != "plain")


@pytest.mark.parametrize("item, message", [("eagle", "expected METHOD.OPTION=VALUE"),
                                           ("ngram.model=x", "'ngram' is not among"),
                                           ("draft_model.tree_topk=99", "tree_topk")])
def test_a_bad_method_option_is_one_clear_error(models, prompt_file, tmp_path, capsys, item, message):
    rc = bench(models, prompt_file, tmp_path / "r.json", "--speculative-method", "draft_model",
               "--method-option", item, "--limit", "1")
    assert rc != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
