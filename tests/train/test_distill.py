"""`specdec distill` end to end on a tiny pair: outputs, training, resumption, the result loads
and drafts losslessly; bad input is one line and a non-zero exit."""
import json

import pytest
import torch

from conftest import make_model_dir, make_pair
from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.train import finetune as ft
from specdec.train.distill_data import Prompt, traffic_prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("distill"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "category": "chat", "turns": [f"Tell me about fox {i} in Paris"]})
                           for i in range(24)))
    return f


def args(pair, prompts, out, *extra):
    t, d = pair
    return ["distill", "--target", str(t), "--draft", str(d), "--prompts", str(prompts), "--output", str(out),
            "--max-tokens", "12", "--eval-prompts", "4", "--heldout-per-mille", "200", "--epochs", "2",
            "--batch-tokens", "48", "--eval-others", "packaged", *extra]


def test_distill_trains_reports_and_the_draft_is_lossless(pair, prompts, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(pair, prompts, out, "--lr", "3e-3")) == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["prompts"]["heldout"] == 4 and res["prompts"]["others"] == 4 and res["prompts"]["train"] == 20
    for when in ("before", "after"):
        assert set(res[when]) == {"heldout", "others"} and res[when]["heldout"]["k"] == 5
    hist = json.loads((out / "draft" / "training.json").read_text())["history"]
    assert hist[-1][2] < hist[0][2]  # the loss on the target's tokens fell
    report = (out / "report.md").read_text()
    assert "acceptance before" in report and (out / "plots" / "distill.png").is_file()
    # the speed stage: plain, the original and the fine-tuned draft side by side, outputs checked
    speed = res["speed"]
    assert speed == json.loads((out / "speed.json").read_text()) and speed["mismatches"] == 0
    assert {speed[s]["prompts"] for s in ("heldout", "others")} == {4}
    assert all(speed[s]["tok_s"][c] > 0 for s in ("heldout", "others") for c in ("plain", "before", "after"))
    assert "speedup before" in report and "identical to plain decoding" in report
    assert len((out / "targets.jsonl").read_text().splitlines()) == 20
    from specdec.tools.bench.prompts import load_prompts
    bench = load_prompts(out / "eval_prompts.jsonl")  # the held-out prompts, for `specdec bench`
    assert [p.category for p in bench].count("heldout") == 4 and all(p.prompt for p in bench)
    # the weights changed, and the directory drafts for the target through the engine, losslessly
    from safetensors.torch import load_file
    new, old = load_file(str(out / "draft" / "model.safetensors")), load_file(str(pair[1] / "model.safetensors"))
    assert set(new) == set(old) and any(not torch.equal(new[k].float(), old[k].float()) for k in new)
    target = LLM(model=str(pair[0]), dtype="float32",
                 speculative_config={"method": "draft_model", "model": str(out / "draft"), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for p in ["Tell me about fox 99", "def fibonacci(n):"]:
        assert target.generate(p, params)[0].outputs[0].token_ids == \
            target.generate(p, params, num_speculative_tokens=0)[0].outputs[0].token_ids
    # a second run finds everything done and changes nothing
    stamp = (out / "draft" / "model.safetensors").stat().st_mtime_ns
    assert main(args(pair, prompts, out, "--lr", "3e-3")) == 0
    assert (out / "draft" / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_interrupted_training_resumes_to_the_same_weights(pair, tmp_path, monkeypatch):
    data = [([5, 6, 7, i % 50 + 10], [20 + i % 7, 30, 31, 32 + i % 3]) for i in range(12)]
    cfg = ft.FinetuneConfig(mode="lora", epochs=2, batch_tokens=8, lora_rank=4, checkpoint_minutes=1e-9, lr=1e-3)
    whole = ft.finetune(pair[1], data, tmp_path / "a", cfg)
    real, calls = ft.sequence_loss, {"n": 0}

    def dies_after_ten(*a, **k):
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ft, "sequence_loss", dies_after_ten)
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(pair[1], data, tmp_path / "b", cfg)
    assert (tmp_path / "b" / ft.CHECKPOINT).is_file() and not (tmp_path / "b" / "draft").exists()
    monkeypatch.setattr(ft, "sequence_loss", real)
    resumed = ft.finetune(pair[1], data, tmp_path / "b", cfg)
    from safetensors.torch import load_file
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)
    ha = json.loads((whole / "training.json").read_text())["history"]
    hb = json.loads((resumed / "training.json").read_text())["history"]
    assert [h[:2] for h in ha] == [h[:2] for h in hb]


def test_recorded_traffic_is_read_and_cut_lines_skipped(tmp_path):
    (tmp_path / "traffic-0.jsonl").write_text(
        json.dumps({"prompt_ids": [1, 2, 3], "output_ids": [4, 5]}) + "\n" + '{"prompt_ids": [1, 2')
    got = list(traffic_prompts(tmp_path, max_prompt=2))
    assert got == [Prompt("traffic-0.jsonl:1", (2, 3), (4, 5))]


@pytest.mark.parametrize("extra,message", [
    (["--epochs", "0"], "--epochs"),
    (["--k", "0"], "--k must be >= 1"),
    (["--speed-prompts", "-1"], "--speed-prompts must be >= 0"),
])
def test_bad_options_exit_non_zero(pair, prompts, tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args(pair, prompts, tmp_path / "x", *extra))
    assert e.value.code != 0 and message in str(e.value.code) + capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(pair, prompts, tmp_path, capsys):
    other = make_model_dir(tmp_path / "other", layers=1, hidden=32)
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["zzz-new-token"] = len(vocab["model"]["vocab"]) + 10
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    t, _ = pair
    cases = [
        (["distill", "--target", str(t), "--draft", str(other), "--prompts", str(prompts), "--output",
          str(tmp_path / "o1")], "tokenizer"),
        (["distill", "--target", str(t), "--draft", str(pair[1]), "--prompts", str(tmp_path / "missing.jsonl"),
          "--output", str(tmp_path / "o2")], "missing.jsonl"),
        (["distill", "--target", str(t), "--draft", str(pair[1]), "--traffic", str(tmp_path / "empty"),
          "--output", str(tmp_path / "o3")], "no recorded traffic"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
