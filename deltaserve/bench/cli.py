"""`deltaserve bench ...` entry point: `main(argv)` parses, runs and maps input errors to exit code 2.

Usage: python -m deltaserve.bench.cli serve --help
       python -m deltaserve.bench.cli sweep --help
"""

import argparse
import sys

from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.serve import add_serve_args, run_serve
from deltaserve.bench.sweep import add_sweep_args, run_sweep

COMMANDS = {"serve": run_serve, "sweep": run_sweep}


def build_parser(prog: str = "deltaserve bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmarks against a running server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="load-test an OpenAI-compatible server (flags and results as `vllm bench serve`)"
    )
    add_serve_args(serve)
    sweep = commands.add_parser(
        "sweep", help="bench serve over a list of concurrencies or rates; one JSON and a throughput/latency plot"
    )
    add_sweep_args(sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `bench <command>`; returns the exit code (2 with a one-line message for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except BenchInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
