"""Deployment configs: one JSON file that says how to run a model, written by `specdec tune`.

``LLM(config=PATH)``, ``specdec generate --config PATH`` and ``specdec serve --config PATH`` load it
as is; anything given explicitly (an argument, a flag) overrides the file's value. The file:

    {
      "specdec_config": 1,                          # the format's version
      "model": "qwen2.5-coder-1.5b",                # or null: the caller names it
      "dtype": "bfloat16",                          # or null: bfloat16
      "quantization": "int4",                       # int4 / int8 / gguf, or null: unquantized
      "speculative_config": {"method": "ngram"},    # or null: plain decoding
      "spec_max_batch": 8,                          # drafting off above this batch size (null: no cap)
      "max_prefill_tokens": 512,                    # chunked prefill per step (null: the default)
      "report": {}                                  # the tuner's notes (reasons, measurements); not read
    }

Every key but ``specdec_config`` may be left out. A directory stands for its ``specdec-config.json``.
Loading checks everything (types, bounds, the speculative config against its method's schema) and
fails with one ``SpecdecError`` line naming the file and the field.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.config import QUANTIZATIONS
from specdec.errors import SpecdecError

FILE_NAME = "specdec-config.json"
VERSION = 1
KEYS = ("specdec_config", "model", "dtype", "quantization", "speculative_config", "spec_max_batch",
        "max_prefill_tokens", "report")  # the file's keys, in the order save() writes them


@dataclass(frozen=True)
class DeploymentConfig:
    """How to run a model; None everywhere: whatever the caller or the defaults say.

    ``speculative_config``: a ``LLM(speculative_config=...)`` dict (None: plain decoding);
    ``spec_max_batch``: drafting is turned off while more sequences than this run (None: no cap);
    ``max_prefill_tokens``: chunked prefill, prompt tokens per engine step (None: the default);
    ``report``: free-form notes of the tuner (reasons, measured figures), ignored by the loaders.
    """

    model: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    speculative_config: dict | None = None
    spec_max_batch: int | None = None
    max_prefill_tokens: int | None = None
    report: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "quantization"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SpecdecError(f"'{name}' must be a non-empty string or null, got {value!r}")
        if self.dtype is not None:
            from specdec.formats.loader import parse_dtype  # noqa: PLC0415 (imports torch)
            try:
                parse_dtype(self.dtype)
            except SpecdecError as e:
                raise SpecdecError(f"'dtype': {e}") from None
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise SpecdecError(f"'quantization' must be one of {', '.join(QUANTIZATIONS)} or null, "
                               f"got {self.quantization!r}")
        for name in ("spec_max_batch", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecdecError(f"'{name}' must be an integer >= 1 or null, got {value!r}")
        if not isinstance(self.report, dict):
            raise SpecdecError(f"'report' must be an object, got {type(self.report).__name__}")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, dict):
                raise SpecdecError(f"'speculative_config' must be an object or null, "
                                   f"got {type(self.speculative_config).__name__}")
            from specdec.proposers.registry import parse_config  # noqa: PLC0415
            try:
                parse_config(self.speculative_config)
            except SpecdecError as e:
                raise SpecdecError(f"'speculative_config': {e}") from None

    # ---- the file ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object, keys in the order of ``KEYS``."""
        return {"specdec_config": VERSION, **{k: getattr(self, k) for k in KEYS[1:]}}

    @classmethod
    def from_dict(cls, d: Any) -> "DeploymentConfig":
        """A config from the file's JSON object, checked (SpecdecError naming the key)."""
        if not isinstance(d, dict):
            raise SpecdecError(f"a deployment config is a JSON object, got {_json_type(d)}")
        if "specdec_config" not in d:
            raise SpecdecError("not a specdec deployment config: no \"specdec_config\": 1 key")
        version = d["specdec_config"]
        if isinstance(version, bool) or version != VERSION:
            raise SpecdecError(f"'specdec_config' is the format's version: this specdec reads version {VERSION}, "
                               f"got {version!r}")
        unknown = [k for k in d if k not in KEYS]
        if unknown:
            raise SpecdecError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                               f"(known: {', '.join(KEYS)})")
        report = d.get("report")
        return cls(**{k: d.get(k) for k in KEYS[1:-1]}, report={} if report is None else report)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DeploymentConfig":
        """Read and check a config file (a directory: its ``specdec-config.json``)."""
        p = Path(path)
        if p.is_dir():
            p = p / FILE_NAME
            if not p.is_file():
                raise SpecdecError(f"no deployment config in directory '{path}' (looked for {FILE_NAME})")
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SpecdecError(f"deployment config '{p}' not found") from None
        except OSError as e:
            raise SpecdecError(f"cannot read deployment config '{p}': {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise SpecdecError(f"deployment config '{p}' is not UTF-8 text") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{p}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        try:
            return cls.from_dict(d)
        except SpecdecError as e:
            raise SpecdecError(f"{p}: {e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the config as JSON (a directory, or a path ending in a separator: its
        ``specdec-config.json``), creating parent directories; returns the file's path."""
        p = Path(path)
        if p.is_dir() or str(path).endswith(("/", os.sep)):
            p = p / FILE_NAME
        p.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)  # a reader never sees half a file
        return p


def resolve(config: str | os.PathLike | DeploymentConfig | None) -> DeploymentConfig:
    """``config`` as a DeploymentConfig (a path is loaded; None: an empty config)."""
    if config is None:
        return DeploymentConfig()
    if isinstance(config, DeploymentConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return DeploymentConfig.load(config)
    raise SpecdecError(f"config must be a path or a DeploymentConfig, got {type(config).__name__}")


def _json_type(v: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(v), type(v).__name__)
