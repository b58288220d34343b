"""`specdec tune` end to end on a tiny pair, and its one-line errors."""
import json

import pytest

from conftest import make_pair
from specdec import SamplingParams
from specdec.tools.tune import candidates
from specdec.tools.tune.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("tune"))


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hello there", "The quick brown fox", "a b a b a b"]))
    return f


def test_tune_measures_decides_and_writes_config_report_and_plots(pair, prompts, tmp_path, capsys):
    from specdec.deploy import DeploymentConfig
    from specdec.llm import LLM

    target, draft = pair
    out = tmp_path / "tuned"
    rc = main(["--model", str(target), "--dtype", "float32", "--prompts", str(prompts), "--output", str(out),
               "--candidates", "ngram", f"draft:{draft}:bf16", "--budget", "3", "--max-tokens", "12",
               "--max-batch", "2", "--no-progress"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    names = {(r["name"], r["k"], r["batch"]) for r in res["measurements"]}
    assert ("plain", 0, 1) in names and ("ngram", 5, 1) in names and (f"draft:{draft}:bf16", 5, 1) in names
    assert any(k != 5 for _, k, _ in names if _ != "plain")  # K was swept
    assert res["mismatches"] == [] and res["plain_by_batch"]  # outputs identical; batch 2 measured
    report = (out / "report.md").read_text()
    assert "## Recommendation" in report and "## Candidates" in report and "speedup_vs_k.png" in report
    assert (out / "plots" / "speedup_vs_k.png").stat().st_size > 0
    cfg = DeploymentConfig.load(out)
    assert cfg.model == str(target) and cfg.report["reasons"]
    llm = LLM(config=out, dtype="float32", progress=False)  # the config runs as is
    assert llm.generate("Hello there", SamplingParams(max_tokens=5))[0].outputs[0].token_ids
    assert "wrote" in capsys.readouterr().out


def test_a_draft_models_prompt_window_is_tuned_where_the_prompts_are_longer(pair, tmp_path, monkeypatch):
    """The winner's ``draft_context`` (issue 58 item 4): each window below the longest prompt measured (the
    windows scaled down to the tiny prompts here), its outputs checked against plain like every other
    configuration, and the report says which it read."""
    from specdec.tools.tune import cli

    target, draft = pair
    monkeypatch.setattr(cli, "CONTEXTS", (4, 8, 10_000))
    monkeypatch.setattr(cli, "KS", ())
    monkeypatch.setattr(cli, "THRESHOLDS", ())
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in ["a b c d e f g h i j k l a b c d e f",
                                                               "one two three four five six seven one two three"]))
    out = tmp_path / "tuned"
    assert main(["--model", str(target), "--dtype", "float32", "--prompts", str(f), "--output", str(out),
                 "--candidates", f"draft:{draft}:bf16", "--budget", "3", "--max-tokens", "8", "--max-batch", "1",
                 "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    windows = sorted(m["spec"].get("draft_context") or 0 for m in res["measurements"] if m["spec"])
    assert windows == [0, 4, 8]  # the whole prompt, then the windows below the longest prompt (not 10,000)
    assert res["mismatches"] == []
    assert "| draft context |" in (out / "report.md").read_text()


@pytest.mark.parametrize("extra,message", [
    (["--candidates", "warp-drive"], "unknown candidate 'warp-drive'"),
    (["--budget", "0.2"], "too small"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(pair, prompts, tmp_path, capsys, extra, message):
    rc = main(["--model", str(pair[0]), "--prompts", str(prompts), "--output", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err and err.count("\n") == 1


def test_an_empty_prompt_file_is_refused(pair, tmp_path, capsys):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    rc = main(["--model", str(pair[0]), "--prompts", str(empty), "--output", str(tmp_path / "o")])
    assert rc == 2 and "error:" in capsys.readouterr().err


def test_candidate_names():
    assert candidates.parse("draft:m").spec == {"method": "draft_model", "model": "m", "quantization": "int4"}
    assert candidates.parse("draft:m:bf16").spec == {"method": "draft_model", "model": "m"}
    assert candidates.parse("self-int4").spec["quantization"] == "int4"
    assert candidates.parse("eagle:/h").spec == {"method": "eagle", "model": "/h"}


def test_the_held_out_check_runs_the_recommendation_against_every_candidates_best(pair, prompts, tmp_path, capsys):
    from specdec.tools.tune import heldout

    out = tmp_path / "tuned"
    assert main(["--model", str(pair[0]), "--dtype", "float32", "--prompts", str(prompts), "--output", str(out),
                 "--candidates", "ngram", "suffix", "--budget", "2", "--max-tokens", "8", "--max-batch", "1",
                 "--no-progress"]) == 0
    names = [c.name for c in heldout.configs(out)]
    assert names[0] == "plain" and len(names) == len(set(names)) and len(names) >= 2
    rc = heldout.main(["--tuned", str(out), "--prompts", str(prompts), "--max-tokens", "8"])
    text = capsys.readouterr().out
    assert rc in (0, 1) and "held-out: 3 prompts" in text and "greedy outputs identical to plain decoding" in text
    assert "behind (promise: within 10%)" in text
