"""OpenAI-compatible HTTP server: `specdec serve` (app.py, scheduler.py, protocol.py, metrics.py).

This module only holds the command line part; the server itself is imported when it runs, so
`specdec --help` stays fast.
"""
from __future__ import annotations

import argparse

DEFAULT_MAX_MODEL_LEN = 4096  # bounds the KV cache: max-batch-size rows x this many positions
DEFAULT_SPEC_MAX_BATCH = 10  # speculate up to this batch size: see scheduler.py for the measurement


def add_serve_parser(sub) -> None:
    """Register `specdec serve` on the CLI's subparsers."""
    from specdec import cli  # noqa: PLC0415 (cli imports this module)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    cli.add_model_args(s)
    cli.add_spec_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--max-batch-size", type=int, default=16, help="KV cache rows: sequences run at once")
    s.add_argument("--spec-max-batch", type=int, default=DEFAULT_SPEC_MAX_BATCH,
                   help="speculate only while at most this many sequences run (default "
                        f"{DEFAULT_SPEC_MAX_BATCH}, the break-even measured on a 2-core CPU)")
    s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415

    from specdec.cli import speculative_config  # noqa: PLC0415
    from specdec.errors import SpecdecError  # noqa: PLC0415
    from specdec.llm import LLM  # noqa: PLC0415
    from specdec.server.app import ServerConfig, create_app  # noqa: PLC0415

    if a.max_batch_size < 1 or a.spec_max_batch < 0:
        raise SpecdecError("--max-batch-size must be >= 1 and --spec-max-batch >= 0")
    if not 0 < a.port < 65536:
        raise SpecdecError(f"--port must be in 1..65535, got {a.port}")
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              max_num_seqs=a.max_batch_size, speculative_config=speculative_config(a),
              quantization=a.quantization)
    if a.max_model_len is None:
        llm.max_model_len = min(llm.max_model_len, DEFAULT_MAX_MODEL_LEN)
    config = ServerConfig(model_name=a.served_model_name or a.model, api_key=a.api_key,
                          max_batch_size=a.max_batch_size, spec_max_batch=a.spec_max_batch)
    app = create_app(llm, config)
    print(f"serving '{config.model_name}' on http://{a.host}:{a.port}/v1 (context {llm.max_model_len}, "
          f"batch {a.max_batch_size}, speculation: {llm.num_speculative_tokens or 'off'})", flush=True)
    # on shutdown, streams still running after 5 s are cancelled (their rows freed) rather than awaited
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    return 0
