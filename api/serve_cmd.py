"""`specdec serve`: the OpenAI-compatible server (chat + completions, SSE streaming, metrics, page).

The models load, then warm up (`specdec.warmup`; `--no-warmup` skips it), on the engine thread
while the server already listens, so `GET /health` answers 503 ("loading", then "warming up") until
the first request will be served warm; if loading fails the server logs why and exits with status 1.

`--replicas N` serves the same API on Ray Serve over N engine replicas (`specdec.api.cluster`).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

logger = logging.getLogger("specdec.api")


def register(sub: argparse._SubParsersAction) -> None:
    from specdec.api.args import add_engine_args, add_warmup_arg
    from specdec.api.reasoning import REASONING_PARSERS
    from specdec.api.tools import TOOL_CALL_PARSERS

    p = sub.add_parser("serve", help="serve the OpenAI API (chat/completions, streaming) over HTTP")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY; "
                        "none: open)")
    p.add_argument("--max-concurrent", type=int, default=64,
                   help="requests admitted at once; more are answered 429 at once")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the target's name)")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="split a thinking model's <think> block into reasoning_content: auto (when the chat "
                        "template writes <think>), none, deepseek_r1 (the answer starts in the reasoning), qwen3")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="the format tool calls are constrained to and parsed in: auto (the one the chat template "
                        "writes), hermes (<tool_call>), qwen3_coder (<function=...> XML), llama3_json, mistral ([TOOL_CALLS])")
    p.add_argument("--strict-fields", action="store_true",
                   help="refuse request fields this server does not know (400 unknown_parameter) instead of "
                        "answering with a Warning header naming them (vLLM's default); fields other servers "
                        "honour that would change the answer are refused either way")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_warmup_arg(p)
    add_engine_args(p)
    from specdec.api.cluster.app import add_cluster_args  # argparse only: Ray is imported by --replicas

    add_cluster_args(p)
    p.set_defaults(func=run)


def served_name(target: str) -> str:
    """`default-target` -> itself; `/models/qwen-1.5b/` -> `qwen-1.5b`; `org/name` -> as is."""
    path = Path(target)
    if path.suffix.lower() == ".gguf":
        return path.stem
    return path.name if path.exists() else target


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec.api.args import engine_config_from_args
    from specdec.api.server import create_app
    from specdec.api.state import ServerSettings
    from specdec.engine import Engine

    config = engine_config_from_args(args)  # bad flags fail here, before anything listens
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_dead(message: str) -> None:
        failed.append(message)
        if server is not None:
            server.should_exit = True

    settings = ServerSettings(
        model_name=args.served_model_name or served_name(config.target), api_key=args.api_key,
        max_concurrent=args.max_concurrent, max_body_bytes=args.max_body_bytes, on_load_error=on_dead,
        warmup=args.warmup, reasoning_parser=args.reasoning_parser, strict_fields=args.strict_fields,
        tool_call_parser=args.tool_call_parser,
    )
    if args.prefill_replicas and args.replicas is None:
        raise ValueError("--prefill-replicas needs --replicas N (prefill and decode replicas are Ray Serve replicas)")
    if args.replicas is not None:
        from specdec.api.cluster import app as cluster

        settings.on_load_error = None  # a replica that fails to load is retried by Ray
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
        return cluster.run(args, config, settings)
    app = create_app(lambda: Engine(config), settings)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    logger.info("serving %r on http://%s:%d (the chat page is at /; /health is 503 while the models "
                "load and warm up)",
                settings.model_name, args.host, args.port)
    if config.resolved_device() == "cpu":
        from specdec import native

        logger.info(native.describe_simd())
    server.run()
    if failed:
        logger.error("specdec serve stopped: %s", failed[0])
        return 1
    return 0
