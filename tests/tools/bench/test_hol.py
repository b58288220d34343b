"""The head-of-line measurement runs end to end against a served tiny model."""
from __future__ import annotations

import json

from specdec.tools.bench import hol


def test_head_of_line_reports_each_streams_slowdown(tiny_model_dir, tmp_path):
    out = tmp_path / "hol.json"
    rc = hol.main(["--serve", f"--model {tiny_model_dir} --dtype float32 --max-prefill-tokens 32", "--streams", "2",
                   "--long-tokens", "150", "--stream-tokens", "150", "--warmup", "0.05", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert len(report["streams"]) == 2 and report["long_seconds"] > 0
    assert all(s["baseline_ms"] > 0 and s["ratio"] > 0 for s in report["streams"])
    # the control run: the same streams without the long prompt, compared over the same tokens
    assert all(s["same_tokens_alone_ms"] > 0 and s["ratio_same_tokens"] > 0 for s in report["streams"])
    assert report["worst_ratio_same_tokens"] == max(s["ratio_same_tokens"] for s in report["streams"])
