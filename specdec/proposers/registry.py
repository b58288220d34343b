"""Speculation method name -> its options schema (which builds the proposer).

The one place that lists the methods. A new method is one module (an options dataclass subclassing
``SpecOptions`` with a ``build(store)`` method, and its Proposer) plus one line in ``METHODS``;
the engine, the CLI, the server and the bench never branch on a method's name.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecdecError
from specdec.proposers.options import SpecOptions

if TYPE_CHECKING:
    from specdec.formats.loader import ModelStore
    from specdec.proposers.base import Proposer

# method name -> (module, options class)
METHODS: dict[str, tuple[str, str]] = {
    "draft_model": ("specdec.proposers.draft_model", "DraftModelOptions"),
    "ngram": ("specdec.proposers.ngram", "NgramOptions"),
    "layer_skip": ("specdec.proposers.layer_skip", "LayerSkipOptions"),
    "cascade": ("specdec.proposers.cascade", "CascadeOptions"),
    "cascade-self": ("specdec.proposers.cascade", "CascadeSelfOptions"),
    "eagle": ("specdec.proposers.eagle", "EagleOptions"),
    "medusa": ("specdec.proposers.medusa", "MedusaOptions"),
    "suffix": ("specdec.proposers.suffix", "SuffixOptions"),
    "grammar": ("specdec.proposers.grammar", "GrammarOptions"),
    "mtp": ("specdec.proposers.mtp", "MtpOptions"),
}
DEFAULT_WITH_MODEL = "draft_model"  # the method of a config that names a 'model' and no 'method'


def config_method(config: dict[str, Any]) -> Any:
    """The method a ``speculative_config`` dict names: its 'method', else the draft model's when it
    names a 'model', else None."""
    return config.get("method") or (DEFAULT_WITH_MODEL if config.get("model") else None)


def schema(method: str) -> type[SpecOptions]:
    """The options class of ``method``."""
    if method not in METHODS:
        raise SpecdecError(f"unknown speculative method {method!r}: use one of {', '.join(METHODS)}")
    module, name = METHODS[method]
    return getattr(importlib.import_module(module), name)


def schemas() -> list[type[SpecOptions]]:
    return [schema(m) for m in METHODS]


def parse_config(config: dict[str, Any] | SpecOptions, where: str | None = None) -> SpecOptions:
    """A ``speculative_config`` dict checked against its method's schema."""
    if isinstance(config, SpecOptions):
        return config
    if not isinstance(config, dict):
        raise SpecdecError("speculative_config must be a dict like {'method': 'draft_model', 'model': ..., "
                           "'num_speculative_tokens': 5}")
    method = config_method(config)
    d = {k: v for k, v in config.items() if k != "method"}
    if method is None:
        raise SpecdecError(f"speculative_config needs a 'method' (one of {', '.join(METHODS)})")
    if not isinstance(method, str):
        raise SpecdecError(f"speculative method must be a string, got {method!r}")
    return schema(method).parse(d, where)


def make_proposer(config: dict[str, Any] | SpecOptions, store: "ModelStore") -> tuple["Proposer", SpecOptions]:
    """The proposer a config describes, built over the target and models of ``store``."""
    opts = parse_config(config)
    proposer = opts.build(store)
    proposer.set_verify(opts.verify)
    return proposer, opts
