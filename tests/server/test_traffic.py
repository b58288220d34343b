"""Recording served traffic (`serve --record-traffic`): what is kept, rotation, the size cap, and a
failing disk that never hurts a request."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler
from specdec.server.traffic import TrafficRecorder


def fake(reason="stop", n=3):
    return SimpleNamespace(finish_reason=reason, prompt_ids=[1, 2, 3], prompt="abc", output_ids=list(range(n)),
                           text="x" * n, params=SimpleNamespace(temperature=0.7))


def lines(rec):
    return [json.loads(x) for p in rec.files() for x in p.read_text().splitlines()]


def test_finished_requests_are_recorded_aborted_ones_are_not(tmp_path):
    rec = TrafficRecorder(tmp_path / "t")
    rec.record(fake("stop"))
    rec.record(fake("abort"))
    rec.record(fake("length", 5))
    rec.close()
    got = lines(rec)
    assert [g["finish_reason"] for g in got] == ["stop", "length"] and rec.records == 2
    assert got[1] | {"time": 0} == {"time": 0, "prompt_ids": [1, 2, 3], "prompt": "abc", "output_ids": [0, 1, 2, 3, 4],
                                    "output": "xxxxx", "temperature": 0.7, "finish_reason": "length"}


def test_files_rotate_and_the_oldest_go_past_the_cap(tmp_path):
    rec = TrafficRecorder(tmp_path, max_total_bytes=1000, max_file_bytes=300)
    for _ in range(40):
        rec.record(fake("stop", 20))
    rec.close()
    files = rec.files()
    assert len(files) >= 3 and all(p.stat().st_size <= 300 for p in files)
    assert sum(p.stat().st_size for p in files) <= 1000
    assert rec._number(files[0]) > 0  # the first files were deleted
    again = TrafficRecorder(tmp_path, max_total_bytes=1000, max_file_bytes=300)  # a restart appends, numbering on
    again.record(fake())
    again.close()
    assert again.files()[-1].name == f"traffic-{rec._number(files[-1]) + 1}.jsonl"


def test_a_failing_disk_stops_the_recording_not_the_request(tmp_path, monkeypatch, caplog):
    rec = TrafficRecorder(tmp_path)
    monkeypatch.setattr(rec, "_write", lambda data: (_ for _ in ()).throw(OSError(28, "No space left")))
    rec.record(fake())
    rec.record(fake())
    assert not rec.enabled and rec.records == 0 and "traffic recording stopped" in caplog.text
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecdecError, match="cannot create the traffic directory"):
        TrafficRecorder(tmp_path / "file" / "sub")  # a file where a directory must go


def test_the_server_records_what_it_served(tiny_model_dir, tmp_path):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    rec = TrafficRecorder(tmp_path / "traffic")
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=2, recorder=rec)
    sched.start()
    params = SamplingParams(temperature=0.0, max_tokens=8)

    async def run():
        handle = sched.submit([llm.make_sequence(p, params) for p in ("Hello", "import os")], asyncio.get_running_loop())
        async for _ in handle.events():
            pass
        return handle.seqs

    try:
        seqs = asyncio.run(run())
    finally:
        sched.stop()
        rec.close()
    got = sorted(lines(rec), key=lambda g: g["prompt"])
    assert [(g["prompt"], g["output_ids"]) for g in got] == sorted((s.prompt, s.output_ids) for s in seqs)
    assert got[0]["output_ids"] == llm.generate("Hello", params)[0].outputs[0].token_ids
