"""Command-line options shared by `specdec generate`, `serve` and `bench`: model, sampling, speculation,
and the deployment config (--config, generate and serve) that may stand in for them.

The speculation flags are built from the methods' option schemas (``proposers/options.py``): one
flag per option, shared by the methods that take it, with the schema's help, bounds and default.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specdec.config import QUANTIZATIONS
from specdec.errors import SpecdecError


def add_model_args(p: argparse.ArgumentParser, config: bool = False) -> None:
    """The model flags; ``config``: also --config FILE (generate, serve), which may name the model
    and dtype in place of --model / --dtype (``deployment_config`` loads it and checks that one
    names the model; --dtype then defaults to None: the config's, else bfloat16)."""
    if config:
        p.add_argument("--config", default=None, metavar="FILE",
                       help="a deployment config written by `specdec tune` (model, dtype, quantization, "
                            "speculative_config, spec_max_batch); flags given here override it (default: none)")
        p.add_argument("--model", default=None,
                       help="embedded model name, HF model directory or .gguf file (required unless --config "
                            "names it)")
        p.add_argument("--dtype", default=None,
                       help="bfloat16, float16 or float32 (default: the --config's, else bfloat16; a GGUF file or "
                            "embedded model given a dtype runs dequantized in it)")
    else:
        p.add_argument("--model", required=True,
                       help="embedded model name, HF model directory or .gguf file (required)")
        p.add_argument("--dtype", default=None,
                       help="bfloat16 (default), float16 or float32 (a GGUF file or embedded model given a dtype "
                            "runs dequantized in it)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="the KV cache's memory: bytes (2GB, 512MiB) or a fraction of this machine's (default 0.4); "
                        "blocks are taken as requests use them")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="the target's weights: int4/int8 (from the bf16 weights) or gguf (the GGUF file's own "
                        "blocks); default: " + ("the --config's, else " if config else "") + "gguf for a GGUF file "
                        "or an embedded model on the CPU unless --dtype is given, else unquantized")


def deployment_config(a: argparse.Namespace):
    """The --config file's ``DeploymentConfig`` (an empty one without --config); SpecdecError when
    neither --model nor the config names the model. Flags override its values: pass both to ``LLM``
    (``LLM(model=a.model, config=cfg, speculative_config=speculative_config(a), ...)``)."""
    from specdec.deploy import DeploymentConfig  # noqa: PLC0415
    cfg = DeploymentConfig.load(a.config) if a.config is not None else DeploymentConfig()
    if a.model is None and cfg.model is None:
        raise SpecdecError("give --model or --config" if a.config is None
                           else f"{a.config}: the config names no model: give --model")
    return cfg


def add_spec_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The speculation flags; ``sweep``: several methods and K values (the bench)."""
    from specdec.proposers.options import cli_flags  # noqa: PLC0415
    from specdec.proposers.registry import METHODS, schemas  # noqa: PLC0415

    g = p.add_argument_group("speculative decoding (`specdec methods` lists every method's options)")
    summaries = "; ".join(f"{s.method}: {s.summary}" for s in schemas())
    g.add_argument("--speculative-method", default=None, choices=tuple(METHODS), nargs="+" if sweep else None,
                   metavar="NAME" if sweep else None,
                   help=("one or more methods (several: a sweep). " if sweep else "")
                   + f"{summaries}. Default: draft_model when --speculative-model is given, else plain decoding")
    if sweep:
        g.add_argument("--num-speculative-tokens", nargs="+", type=int, default=[5], metavar="K",
                       help="draft length(s) K (several: a sweep; default 5)")
    for flag, name, kw in cli_flags(schemas(), skip=("num_speculative_tokens",) if sweep else ()):
        if sweep and name in SWEPT:  # several values: one column each (a chain against trees)
            kw = kw | {"nargs": "+", "help": f"{kw['help']}; several: a sweep"}
        g.add_argument(flag, dest=f"spec_{name}", **kw)


SWEPT = ("tree_topk",)  # options besides K and the method that `specdec bench` sweeps


def spec_flag_values(a: argparse.Namespace) -> dict:
    """The speculation options' values (dest ``spec_<option>``); other ``spec_*`` flags such as the
    server's --spec-max-batch are not options of a method."""
    from specdec.proposers.options import cli_flags  # noqa: PLC0415
    from specdec.proposers.registry import schemas  # noqa: PLC0415
    names = {name for _, name, _ in cli_flags(schemas())}
    return {k[len("spec_"):]: v for k, v in vars(a).items() if k.startswith("spec_") and k[len("spec_"):] in names}


def speculative_config(a: argparse.Namespace, method: str | None = None, strict: bool = True) -> dict | None:
    """The ``speculative_config`` dict the CLI flags describe (None: plain decoding), checked against
    the method's schema. ``method`` overrides --speculative-method (a bench sweep, ``strict=False``:
    flags of other methods are ignored)."""
    from specdec.proposers.options import cli_flags, config_from_flags  # noqa: PLC0415
    from specdec.proposers.registry import DEFAULT_WITH_MODEL, parse_config, schema, schemas  # noqa: PLC0415

    values = spec_flag_values(a)
    method = method or a.speculative_method or (DEFAULT_WITH_MODEL if values.get("model") else None)
    if method is None:
        given = sorted(k for k, v in values.items() if v is not None)
        if given:
            raise SpecdecError(f"speculative options given ({', '.join(given)}) but no method: add "
                               "--speculative-method NAME (or --speculative-model for a draft model)")
        return None
    flags = {name: flag for flag, name, _ in cli_flags(schemas())}
    cfg = config_from_flags(schema(method), values, strict=strict, flags=flags)
    parse_config(cfg)  # bad values fail here, with the flag's field named
    return cfg


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default -1: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the smallest set with this mass "
                                                             "(default 1.0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * p_max (default 0: off)")
    g.add_argument("--seed", type=int, default=None, help="random seed of a sampled request (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token already in the output (OpenAI; in [-2, 2]; "
                        "default 0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count in the output from each token's logit (OpenAI; in [-2, 2]; "
                        "default 0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive / multiply negative logits of tokens in the prompt or output (vLLM; "
                        "default 1: off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]) to a token's logit (repeatable; default: none)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's raw model logprob and its N most likely alternatives "
                        "(default: none)")


def add_structured_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (at most one; the output is guaranteed to match)")
    g.add_argument("--json-schema", metavar="FILE_OR_JSON", default=None,
                   help="the output is JSON valid for this JSON schema (a file, or the schema's JSON text; "
                        "default: none)")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="RE", default=None,
                   help="the output matches this regular expression (default: none)")
    g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is one of these strings (repeatable; default: none)")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="the output is a sentence of this grammar file (Lark, or GBNF with ::= rules; default: none)")


def structured_output(a: argparse.Namespace) -> dict | None:
    """The structured-output dict the flags describe (None: unconstrained); SpecdecError for two
    constraints, an unreadable file or a schema that is not a JSON object."""
    flags = {"--json-schema": a.json_schema, "--json-object": a.json_object or None, "--regex": a.regex,
             "--choice": a.choice, "--grammar": a.grammar}
    given = {flag: v for flag, v in flags.items() if v is not None}
    if len(given) > 1:
        raise SpecdecError(f"give at most one of --json-schema, --json-object, --regex, --choice, --grammar; "
                           f"got {', '.join(given)}")
    if not given:
        return None
    flag, value = next(iter(given.items()))
    if flag == "--json-schema":
        inline = value.lstrip().startswith("{")
        try:
            schema = json.loads(value if inline else _read_text(value, flag))
        except ValueError as e:
            raise SpecdecError(f"{flag}: {'' if inline else repr(value) + ' is '}not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise SpecdecError(f"{flag}: a JSON schema is a JSON object, got {type(schema).__name__}")
        return {"json": schema}
    if flag == "--grammar":
        return {"grammar": _read_text(value, flag)}
    return {"json_object": True} if flag == "--json-object" else {flag[2:]: value}


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecdecError(f"{flag}: cannot read '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SpecdecError(f"{flag}: '{path}' is not UTF-8 text") from None


def sampling_params(a: argparse.Namespace):
    from specdec.config import SamplingParams  # noqa: PLC0415
    bias = {}
    for item in a.logit_bias:
        tok, _, val = item.partition("=")
        try:
            bias[int(tok)] = float(val)
        except ValueError:
            raise SpecdecError(f"--logit-bias takes TOKEN_ID=BIAS (e.g. 1234=-100), got {item!r}") from None
    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          max_tokens=a.max_tokens, stop=tuple(a.stop), seed=a.seed, ignore_eos=a.ignore_eos,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          repetition_penalty=a.repetition_penalty, logit_bias=bias or None, logprobs=a.logprobs,
                          structured_output=structured_output(a) if hasattr(a, "json_schema") else None)


def command_line(sub: str) -> str:
    """This process's command as ``specdec SUB ...`` for a report (``specdec SUB`` alone when the
    subcommand was run from Python, not from the command line)."""
    return shlex.join(["specdec", *sys.argv[1:]]) if sys.argv[1:2] == [sub] else f"specdec {sub}"
