"""One options schema per speculation method: typed fields with bounds and help text.

Each method's module declares a frozen dataclass subclassing ``SpecOptions``; its fields are made
with ``option(...)``. From that one declaration:

* the registry validates a ``speculative_config`` dict (unknown keys, types, bounds, choices: one
  clear ``SpecdecError`` naming the key and what it takes);
* the CLI builds its ``--flags`` (``cli_flags`` / ``config_from_flags``);
* the server accepts per-request overrides of the fields marked ``per_request``;
* the docs list every method's options (``markdown_table``).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specdec.errors import SpecdecError

_MISSING = dataclasses.MISSING
VERIFY_MODES = ("rejection", "gumbel")  # sampling.rejection, sampling.gumbel


def option(default: Any = _MISSING, *, help: str, lo: float | None = None, hi: float | None = None,  # noqa: A002
           lo_open: bool = False, hi_open: bool = False, choices: tuple | None = None,
           flag: str | None = None, cli: bool = True, per_request: bool = False, required: bool = False,
           items: type | None = None) -> Any:
    """A schema field: ``lo``/``hi`` bound numbers (open with ``lo_open``/``hi_open``), ``choices``
    lists allowed values, ``flag`` names the CLI flag (default ``--name-with-dashes``; ``cli=False``:
    none), ``per_request``: a request may override it, ``items``: element type of a list field."""
    meta = dict(help=help, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, choices=choices, flag=flag, cli=cli,
                per_request=per_request, required=required, items=items)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=None if default is _MISSING else default, metadata=meta)


@dataclass(frozen=True)
class SpecOptions:
    """Options every method takes. Subclasses set ``method`` and add their own fields."""

    method: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    num_speculative_tokens: int = option(5, lo=1, hi=32, per_request=True,
                                         help="draft length K: tokens drafted per step (per request: at most)")
    adaptive: bool = option(False, help="adapt K to each request's acceptance and pause drafting where it is "
                                        "measured not to pay")
    cost_aware: bool = option(True, flag="--no-cost-aware",
                              help="choose each step's K (down to 0: plain decoding, with probes) from the measured "
                                   "cost of verifying K + 1 tokens at the batch size and the request's context "
                                   "length, the drafts' acceptance and the drafter's time")
    grammar_draft: bool = option(True, flag="--no-grammar-draft", help="on structured-output requests, draft the tokens the grammar forces "
                                            "(free, always accepted) where it forces some")
    verify: str = option("rejection", choices=VERIFY_MODES, flag="--speculative-verify",
                         help="how sampled tokens are verified: rejection (speculative sampling) or gumbel (Gumbel-max "
                              "with keyed noise, drafts checked by equality: a seeded request gets plain decoding's "
                              "tokens, speculation on or off)")

    # ---- parsing ----------------------------------------------------------------------------
    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def parse(cls, config: dict[str, Any], where: str | None = None) -> "SpecOptions":
        """Validate ``config`` (without 'method') against the schema; one error names what is wrong."""
        where = where or f"speculative method {cls.method!r}"
        names = {f.name: f for f in cls.fields()}
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise SpecdecError(f"unknown option(s) for {where}: {', '.join(unknown)} (it takes "
                               f"{', '.join(names)}; `specdec methods` lists them)")
        values = {}
        hints = typing.get_type_hints(cls)
        for name, f in names.items():
            if name in config:
                values[name] = _check(name, config[name], hints[name], f.metadata, where)
            elif f.metadata.get("required"):
                raise SpecdecError(f"{where} needs {name!r}: {f.metadata['help']}"
                                   + (f" (CLI: {flag_name(f)})" if f.metadata.get("cli") else ""))
        opts = cls(**values)
        opts.check()
        return opts

    def check(self) -> None:
        """Checks across fields; a subclass raises SpecdecError when its fields do not fit together."""

    @property
    def drafts_trees(self) -> bool:
        """Whether the proposer these options build drafts token trees (``Draft.parents``), not chains: a
        hybrid target, whose recurrent states follow one chain, refuses such a method (``LLM``)."""
        return False

    def build(self, store):  # -> Proposer; store: formats.loader.ModelStore
        """The proposer these options describe, over the target (and draft models) of ``store``."""
        raise NotImplementedError

    @classmethod
    def per_request(cls) -> list[str]:
        return [f.name for f in cls.fields() if f.metadata.get("per_request")]

    @classmethod
    def check_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        """A request's overrides of the per-request fields, checked like the config itself."""
        fields = {f.name: f for f in cls.fields() if f.metadata.get("per_request")}
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise SpecdecError(f"per-request speculative options of {cls.method!r} are {', '.join(fields)}, "
                               f"not {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        return {k: _check(k, v, hints[k], fields[k].metadata, "this request") for k, v in overrides.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **{f.name: getattr(self, f.name) for f in self.fields()}}


@dataclass(frozen=True)
class TreeBudgetOptions(SpecOptions):
    """Options of a method that can draft a token tree: its node budget may be measured."""

    tree_budget: str | None = option(None, choices=("auto",),
                                     help="auto: a tree's node budget per step (at most K) from the measured cost "
                                          "of verifying T tokens on the loaded target at the batch size: the largest "
                                          "T within 1.25x of one token (engine.budget); unset: K")


def _check(name: str, value: Any, hint: Any, meta: dict, where: str) -> Any:
    """``value`` checked against the field's type hint, bounds and choices."""
    kinds = _kinds(hint)
    if value is None:
        if type(None) in kinds:
            return None
        raise SpecdecError(f"{name} of {where} may not be null")
    kind = next((k for k in kinds if _is(value, k)), None)
    if kind is None:
        want = " or ".join(_type_name(k) for k in kinds if k is not type(None))
        raise SpecdecError(f"{name} of {where} must be {want}, got {value!r}")
    if kind is float:
        value = float(value)
    if kind is list:
        item = meta.get("items")
        if item is not None and not all(_is(v, item) for v in value):
            raise SpecdecError(f"{name} of {where} must be a list of {_type_name(item)}, got {value!r}")
        value = list(value)
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise SpecdecError(f"{name} of {where} must be one of {', '.join(map(str, meta['choices']))}, got {value!r}")
    if kind in (int, float):
        lo, hi = meta.get("lo"), meta.get("hi")
        bad_lo = lo is not None and (value <= lo if meta.get("lo_open") else value < lo)
        bad_hi = hi is not None and (value >= hi if meta.get("hi_open") else value > hi)
        if bad_lo or bad_hi:
            raise SpecdecError(f"{name} of {where} must be in {_range(meta)}, got {value!r}")
    return value


def _kinds(hint: Any) -> list[type]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return [k for a in typing.get_args(hint) for k in _kinds(a)]
    origin = typing.get_origin(hint)
    return [origin if origin is not None else hint]


def _is(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, tuple))
    return isinstance(value, kind)


def _type_name(kind: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(kind, kind.__name__)


def _range(meta: dict) -> str:
    lo, hi = meta.get("lo"), meta.get("hi")
    left = "-inf" if lo is None else f"{lo:g}"
    right = "inf" if hi is None else f"{hi:g}"
    return f"{'(' if meta.get('lo_open') or lo is None else '['}{left}, {right}{')' if meta.get('hi_open') or hi is None else ']'}"


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def describe(f: dataclasses.Field, hint: Any) -> str:
    """One line: the help text, the allowed values and the default."""
    meta, parts = f.metadata, [f.metadata["help"]]
    kinds = [k for k in _kinds(hint) if k is not type(None)]
    if meta.get("choices") is not None:
        parts.append("one of " + ", ".join(map(str, meta["choices"])))
    elif kinds and kinds[0] in (int, float) and (meta.get("lo") is not None or meta.get("hi") is not None):
        parts.append(f"in {_range(meta)}")
    default = f.default if f.default is not _MISSING else (f.default_factory() if f.default_factory is not _MISSING
                                                          else None)
    parts.append("required" if meta.get("required") else f"default {default!r}")
    return "; ".join(parts)


def markdown_table(schemas: list[type[SpecOptions]]) -> str:
    """Every method's options as one markdown table (docs/methods.md holds this, checked by a test)."""
    lines = ["| method | option | CLI flag | per request | what it is |", "|---|---|---|---|---|"]
    for cls in schemas:
        hints = typing.get_type_hints(cls)
        for f in cls.fields():
            flag = f"`{flag_name(f)}`" if f.metadata.get("cli") else "-"
            lines.append(f"| `{cls.method}` | `{f.name}` | {flag} | {'yes' if f.metadata.get('per_request') else ''} "
                         f"| {describe(f, hints[f.name])} |")
    return "\n".join(lines)


def cli_flags(schemas: list[type[SpecOptions]], skip: tuple[str, ...] = ()) -> list[tuple[str, str, dict]]:
    """(flag, field name, argparse keyword arguments) for the union of every schema's CLI fields
    (less ``skip``). A field several methods share is one flag; its help names the methods."""
    seen: dict[str, tuple[str, dict, list[str], list[str]]] = {}  # name -> flag, kwargs, methods, helps
    for cls in schemas:
        hints = typing.get_type_hints(cls)
        for f in cls.fields():
            if not f.metadata.get("cli") or f.name in skip:
                continue
            text = describe(f, hints[f.name])
            if f.name in seen:
                seen[f.name][2].append(cls.method)
                seen[f.name][3].append(text)
                continue
            kinds = [k for k in _kinds(hints[f.name]) if k is not type(None)]
            kw: dict[str, Any] = {"default": None}
            if kinds[0] is bool:  # a flag sets the opposite of the default (--adaptive, --no-grammar-draft)
                kw.update(action="store_const", const=f.default is not True)
            elif kinds[0] is list:
                kw.update(nargs="+", type=f.metadata.get("items") or str, metavar=f.name.upper())
            else:
                kw.update(type=kinds[0], metavar=f.name.upper())
                if f.metadata.get("choices") is not None:
                    kw["choices"] = f.metadata["choices"]
            seen[f.name] = (flag_name(f), kw, [cls.method], [text])
    out = []
    for name, (flag, kw, methods, helps) in seen.items():
        if len(methods) == len(schemas):
            kw["help"] = helps[0]
        elif len(set(helps)) == 1:
            kw["help"] = f"{', '.join(methods)}: {helps[0]}"
        else:
            kw["help"] = "; ".join(f"{m}: {h}" for m, h in zip(methods, helps))
        out.append((flag, name, kw))
    return out


def config_from_flags(cls: type[SpecOptions], values: dict[str, Any], strict: bool = True,
                      flags: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``speculative_config`` dict for method ``cls`` from parsed CLI values (None: not given).
    ``strict``: a flag the method does not take is an error (else it is ignored: a sweep of methods)."""
    own = {f.name: f for f in cls.fields() if f.metadata.get("cli")}
    foreign = sorted(k for k, v in values.items() if v is not None and k not in own)
    if strict and foreign:
        names = [(flags or {}).get(k) or "--" + k.replace("_", "-") for k in foreign]
        raise SpecdecError(f"speculative method {cls.method!r} takes no {', '.join(names)}: drop "
                           f"{'it' if len(foreign) == 1 else 'them'} (`specdec methods` lists each method's options)")
    return {"method": cls.method, **{k: v for k, v in values.items() if k in own and v is not None}}
