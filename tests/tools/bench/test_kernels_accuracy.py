"""The kernel and accuracy benchmarks run end to end on tiny inputs and reject bad arguments."""
import json

from specdec.tools.bench import accuracy, kernels


def test_kernel_benchmark_writes_results_and_plot(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = kernels.main(["--shape", "64x64", "--rows", "1,2", "--pool-gib", "0.0001", "--repeats", "1",
                       "--kinds", "bf16 oneDNN packed,int4 specdec,int8 specdec", "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["kinds"]) == {"bf16 oneDNN packed", "int4 specdec", "int8 specdec"}
    assert all(r["ms"]["1"] > 0 for r in res["kinds"].values() if r)
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| int4 specdec |" in capsys.readouterr().out


def test_kernel_benchmark_rejects_bad_arguments(capsys):
    assert kernels.main(["--shape", "64x40"]) == 2
    assert kernels.main(["--kinds", "int3"]) == 2
    assert "error:" in capsys.readouterr().err


def test_accuracy_benchmark_on_a_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "a.json"
    rc = accuracy.main(["--model", str(tiny_model_dir), "--kinds", "int8,int4", "--tokens", "200",
                        "--window", "64", "--output", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["none", "int8", "int4"]
    assert rows[0]["top1_agreement"] == 1.0 and all(r["perplexity"] > 1 for r in rows)
    assert rows[2]["quantized_weight_bytes"] < rows[1]["quantized_weight_bytes"]


def test_accuracy_benchmark_unknown_model_is_one_line(capsys):
    assert accuracy.main(["--model", "no-such-model", "--kinds", "int8"]) == 2
    assert "unknown model" in capsys.readouterr().err
