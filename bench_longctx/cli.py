"""The `kvtier` command: demo, serve, verify, generate, bench.

It sits at the top of the layout (it reaches every package below it). Each subcommand's module is
imported only when that subcommand runs (serve needs no torch kernels, demo no fastapi), by a plain
import statement, so the import walk in tests/test_imports.py sees every arrow.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Callable


def _demo() -> ModuleType:
    from kvstore import demo
    return demo


def _serve() -> ModuleType:
    from kvstore.service import serve
    return serve


def _verify() -> ModuleType:
    from kvstore.service import verify
    return verify


def _generate() -> ModuleType:
    from engine_adapter import generate_cli
    return generate_cli


def _bench() -> ModuleType:
    from bench_longctx import bench_command
    return bench_command


# name -> (loader of a module with add_arguments(parser) and run(args), help)
COMMANDS: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "demo": (_demo, "store a long synthetic sequence through every tier and verify it"),
    "serve": (_serve, "run the sidecar service (FastAPI + uvicorn)"),
    "verify": (_verify, "check a sidecar's store (--data-dir) and copy its intact values out"),
    "generate": (_generate, "greedy decoding with a real or random-weight model"),
    "bench": (_bench, "long-context benchmarks: speed and accuracy in one run"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache memory manager.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (load, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            load().add_arguments(p)
    args = parser.parse_args(argv)
    return COMMANDS[args.command][0]().run(args)


if __name__ == "__main__":
    raise SystemExit(main())
