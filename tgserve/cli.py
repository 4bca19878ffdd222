"""The `tgserve` command line. The only place that reads environment variables."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tgserve", description="Text-generation inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    from tgserve.router.bench.cli import add_bench_command
    from tgserve.router.launcher import add_serve_command
    from tgserve.server.engine.cli_generate import add_generate_command
    from tgserve.server.engine.cli_sparse_search import add_sparse_search_command

    add_generate_command(sub)
    add_sparse_search_command(sub)
    add_serve_command(sub)
    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
