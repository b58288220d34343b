"""Deployment config files: save / load round trip, a directory standing for its file, and one
clear SpecdecError naming the problem for every kind of bad file."""
from __future__ import annotations

import json

import pytest

from specdec.deploy import FILE_NAME, KEYS, DeploymentConfig
from specdec.errors import SpecdecError

FULL = DeploymentConfig(model="qwen2.5-coder-1.5b", dtype="bfloat16", quantization="int4",
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
                        spec_max_batch=8, max_prefill_tokens=256,
                        report={"reason": "ngram beat draft_model on code", "tokens_per_second": {"plain": 6.6}})


def test_round_trip_keeps_every_field_in_the_documented_order(tmp_path):
    path = FULL.save(tmp_path / "deploy" / "tuned.json")  # parent directories are created
    assert path == tmp_path / "deploy" / "tuned.json"
    text = path.read_text()
    assert text.endswith("\n") and text.startswith('{\n  "specdec_config": 1,\n')
    assert list(json.loads(text)) == list(KEYS)
    assert DeploymentConfig.load(path) == FULL
    assert DeploymentConfig.load(str(path)) == FULL
    empty = DeploymentConfig()
    assert DeploymentConfig.load(empty.save(tmp_path / "empty.json")) == empty


def test_a_directory_stands_for_its_specdec_config_json(tmp_path):
    assert FULL.save(tmp_path) == tmp_path / FILE_NAME  # an existing directory
    assert DeploymentConfig.load(tmp_path) == FULL
    assert FULL.save(f"{tmp_path}/new/") == tmp_path / "new" / FILE_NAME  # a path ending in a separator
    assert DeploymentConfig.load(tmp_path / "new") == FULL
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdecError, match=f"no deployment config in directory .*empty.*{FILE_NAME}"):
        DeploymentConfig.load(tmp_path / "empty")


def test_keys_may_be_left_out(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"specdec_config": 1, "speculative_config": {"method": "ngram"}}')
    cfg = DeploymentConfig.load(path)
    assert cfg.model is None and cfg.speculative_config == {"method": "ngram"} and cfg.report == {}


@pytest.mark.parametrize("text,words", [
    ('{"specdec_config": 1, "model": "m",', ["not valid JSON", "line 1 column"]),
    ('{\n  "specdec_config": 1\n  "model": "m"\n}', ["not valid JSON", "line 3 column 3"]),
    ('["specdec_config", 1]', ["JSON object", "array"]),
    ('{"model": "m"}', ["no \"specdec_config\": 1"]),
    ('{"specdec_config": 2}', ["'specdec_config'", "version 1", "got 2"]),
    ('{"specdec_config": "1"}', ["'specdec_config'", "got '1'"]),
    ('{"specdec_config": 1, "modle": "m", "k": 5}', ["unknown keys 'modle', 'k'"]),
    ('{"specdec_config": 1, "model": 7}', ["'model'", "string"]),
    ('{"specdec_config": 1, "model": ""}', ["'model'", "non-empty"]),
    ('{"specdec_config": 1, "dtype": "float13"}', ["'dtype'", "unknown dtype 'float13'"]),
    ('{"specdec_config": 1, "quantization": "int3"}', ["'quantization'", "int4, int8, gguf"]),
    ('{"specdec_config": 1, "spec_max_batch": 0}', ["'spec_max_batch'", ">= 1", "got 0"]),
    ('{"specdec_config": 1, "spec_max_batch": 2.5}', ["'spec_max_batch'", "integer"]),
    ('{"specdec_config": 1, "spec_max_batch": true}', ["'spec_max_batch'", "integer"]),
    ('{"specdec_config": 1, "max_prefill_tokens": -4}', ["'max_prefill_tokens'", ">= 1"]),
    ('{"specdec_config": 1, "max_prefill_tokens": "512"}', ["'max_prefill_tokens'", "integer"]),
    ('{"specdec_config": 1, "speculative_config": "ngram"}', ["'speculative_config'", "object"]),
    ('{"specdec_config": 1, "speculative_config": {"num_speculative_tokens": 3}}',
     ["'speculative_config'", "needs a 'method'"]),
    ('{"specdec_config": 1, "speculative_config": {"method": "nope"}}',
     ["'speculative_config'", "unknown speculative method 'nope'"]),
    ('{"specdec_config": 1, "speculative_config": {"method": "ngram", "prompt_lookup_min": 0}}',
     ["'speculative_config'", "prompt_lookup_min", "[1, 64]"]),
    ('{"specdec_config": 1, "speculative_config": {"method": "draft_model"}}', ["'speculative_config'", "'model'"]),
    ('{"specdec_config": 1, "report": [1, 2]}', ["'report'", "object"]),
])
def test_bad_files_are_one_line_errors_naming_the_file_and_the_problem(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SpecdecError) as e:
        DeploymentConfig.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    for w in words:
        assert w in msg, msg


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(SpecdecError, match="deployment config '.*nope.json' not found"):
        DeploymentConfig.load(tmp_path / "nope.json")
    (tmp_path / "latin1.json").write_bytes(b'{"specdec_config": 1, "model": "\xe9"}')
    with pytest.raises(SpecdecError, match="not UTF-8"):
        DeploymentConfig.load(tmp_path / "latin1.json")


def test_constructing_a_bad_config_fails_too():
    with pytest.raises(SpecdecError, match="'spec_max_batch'"):
        DeploymentConfig(spec_max_batch=0)
    with pytest.raises(SpecdecError, match="'speculative_config'.*method"):
        DeploymentConfig(speculative_config={"method": "nope"})
