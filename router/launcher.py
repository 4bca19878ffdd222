"""`tgserve serve`: the command-line entry of the server.

Registering the command imports nothing heavy (no FastAPI, uvicorn or ZMQ), so that `tgserve generate`
keeps working where only the engine's packages are installed; `router.supervisor` does the serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
from typing import Any

from tgserve.router import serve_args


def add_serve_command(subparsers: Any) -> None:
    """Register `tgserve serve` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over HTTP (OpenAI and TGI APIs)",
        description="Serve a model over HTTP with an OpenAI-compatible and a TGI-native API. "
        "Every flag can also be set by its environment variable; HF_TOKEN and HF_HOME are honoured "
        "for Hub downloads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve_args.add_serve_flags(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """The `serve` command. Returns the process exit status (1 when the engine failed or died)."""
    from tgserve.router.supervisor import serve

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    config = serve_args.router_config(args)
    ipc_dir = tempfile.mkdtemp(prefix="tgserve-")
    try:
        return asyncio.run(serve(args, config, ipc_dir))
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
