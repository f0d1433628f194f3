"""The `kvtier` command: demo, serve, verify, generate, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with add_arguments(parser) and run(args), help)
COMMANDS = {
    "demo": ("kvstore.demo", "store a long synthetic sequence through every tier and verify it"),
    "serve": ("kvstore.service.cli", "run the sidecar service (FastAPI + uvicorn)"),
    "verify": ("kvstore.service.verify", "check a sidecar's store (--data-dir) and copy its intact values out"),
    "generate": ("engine_adapter.generate_cli", "greedy decoding with a real or random-weight model"),
    "bench": ("bench_longctx.cli", "long-context benchmarks: speed and accuracy in one run"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache memory manager.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # import only what runs: serve needs no torch kernels, demo no fastapi
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
