"""The family table (specdec/families.py) is the one place that knows a family by its name.

Every decision that depends on the family reads a field of its row: no code outside the table compares a
family's name (a ``model_type``, a GGUF architecture, an alias) with a literal, and each row maps both ways,
so a tiny config of every family goes config -> ``to_hf`` -> config unchanged. RoPE is computed from the
config's fields, never from a rebuilt ``config.json``.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from specdec.config import ModelConfig
from specdec.families import ALIASES, FAMILIES, WRAPPERS, family

ROOT = Path(__file__).resolve().parents[1]
# comparisons of a family's name with a literal allowed outside specdec/families.py (issue 55 allowed 2; none is
# left: a family's difference is a field of its row)
MAX_OUTSIDE = 0


def _comparison() -> re.Pattern:
    """A comparison of an architecture / model_type / family name with the literal name of a family."""
    names = {n for f in FAMILIES.values() for n in (f.model_type, f.gguf_arch)} | set(ALIASES) | set(WRAPPERS)
    lit = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    subject = r"\b(?:arch|architecture|model_type|hf_arch|mt)\b"
    return re.compile(rf"""{subject}\s*(?:==|!=|\bnot\s+in\b|\bin\b)\s*[(\[{{]?[^\n]*?["'](?:{lit})["']"""
                      rf"""|["'](?:{lit})["']\s*(?:==|!=)\s*[\w.]*{subject}""")


def family_name_comparisons() -> list[str]:
    """``path:line: code`` of every family-name comparison in specdec/ outside the family table."""
    pattern, found = _comparison(), []
    for path in sorted((ROOT / "specdec").rglob("*.py")):
        if path == ROOT / "specdec" / "families.py":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return found


def test_the_pattern_finds_family_name_comparisons():
    pattern = _comparison()
    for line in ('if arch == "gemma2":', 'd["x"] = 1 if config.architecture in ("mixtral", "gpt_oss") else 2',
                 'if windows and fam.model_type == "llama":', 'if "qwen3_5_text" == cfg.architecture:',
                 'bias = d.get("attention_bias", arch != "qwen2")', 'if model_type not in ("gpt-oss", "glm4moe"):'):
        assert pattern.search(line), line
    for line in ('if pre == "qwen2":', 'if tokenizer_model not in (None, "llama"):', 'if arch == "aarch64":',
                 'if self.mixer(i) == "attention":', 'if fam.mtp_layout == "mtp":'):
        assert not pattern.search(line), line


def test_no_family_name_is_compared_outside_the_family_table():
    found = family_name_comparisons()
    assert len(found) <= MAX_OUTSIDE, ("a family's name compared outside specdec/families.py: make the decision a "
                                       "field of the Family row instead\n" + "\n".join(found))


def test_every_row_names_what_exists():
    """The families a row points to exist; its layouts are ones the generic code knows."""
    for f in FAMILIES.values():
        for other in (f.gguf_experts, f.gguf_windowed):
            assert not other or (other in FAMILIES and FAMILIES[other].gguf_arch == f.gguf_arch), f.model_type
        assert f.hf_rope in ("rope_scaling", "rope_parameters", "by_layer_type"), f.model_type
        assert f.mtp_layout in ("", "layers", "mtp"), f.model_type
        assert {m for m, _ in f.hf_mixers} <= {"conv", "delta"}, f.model_type
        assert family(f.model_type) is f
    assert all(a in FAMILIES for a in {*ALIASES.values(), *WRAPPERS.values()})


def tiny_configs() -> dict[str, ModelConfig]:
    """A tiny ModelConfig of every family, read from transformers' config of it (tests/family_util.py)."""
    from family_util import _ALL, family_config
    from glm_util import GLM_CONFIG

    out = {}
    for name, (model_type, _) in _ALL.items():
        out.setdefault(model_type, family_config(name))
    out["glm4_moe"] = ModelConfig.from_hf({**GLM_CONFIG, "vocab_size": 97, "num_nextn_predict_layers": 1,
                                           "model_type": "glm4_moe"})
    qwen2 = {"model_type": "qwen2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6}
    out["qwen2"] = ModelConfig.from_hf(qwen2)
    return out


def test_every_row_round_trips_a_tiny_config():
    """config -> to_hf (as JSON) -> config, for a tiny config of every family and a few variations the
    loaders make (ids of the special tokens, no windows on a windowed family, a second eos)."""
    pytest.importorskip("transformers")
    configs = tiny_configs()
    assert set(configs) == set(FAMILIES), "a family without a tiny config here: add one"
    for name, cfg in configs.items():
        assert cfg.architecture == name
        variants = [cfg, dataclasses.replace(cfg, bos_token_id=1, eos_token_ids=(2, 3))]
        if cfg.layer_windows and family(name).hf_layer_types:
            variants.append(dataclasses.replace(cfg, layer_windows=tuple(0 for _ in cfg.layer_windows[:-1]) + (8,)))
        for c in variants:
            d = json.loads(json.dumps(c.to_hf()))
            assert d["model_type"] == name and d["architectures"] == [family(name).hf_class]
            assert ModelConfig.from_hf(d) == c, name


def test_rope_is_computed_from_the_fields(monkeypatch):
    """YaRN, LongRoPE (partial rotary dimensions) and Gemma 3's linear scaling: transformers' own functions on
    the config's fields give what they give on transformers' config of the family, and no config.json is
    rebuilt for them."""
    pytest.importorskip("transformers")
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from family_util import family_config
    from specdec.families import hf_config
    from specdec.models import llama

    for name in ("gpt_oss", "phi3", "gemma3"):
        cfg = family_config(name)
        tc = hf_config(cfg.architecture, cfg.to_hf())
        kind = cfg.rope_scaling["rope_type"]
        per_type = {"layer_type": "full_attention"} if name == "gemma3" else {}
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](tc, "cpu", **per_type)
        with monkeypatch.context() as m:
            m.setattr(ModelConfig, "to_hf", lambda self: pytest.fail("to_hf called to compute RoPE"))
            llama._ROPES.clear()
            got, factor = llama.rope_frequencies(cfg), llama.rope_attention_factor(cfg)
        assert torch.equal(got, want.float()) and got.shape == (cfg.rotary_dim // 2,), name
        assert factor == want_factor, name
