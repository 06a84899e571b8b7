"""The `ferry` console script: each subcommand's options and code live with the part they drive."""
from __future__ import annotations

import argparse
import os
import sys

BENCH_HELP = "measure Ferry: `ferry bench NAME [flags]` runs `python -m benchmarks NAME [flags]` (`ferry bench --help`)"


def build_parser() -> argparse.ArgumentParser:
    from ferry.generate import add_generate_parser
    from ferry.launcher import add_up_parser

    parser = argparse.ArgumentParser(prog="ferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_up_parser(sub)
    add_generate_parser(sub)
    sub.add_parser("bench", help=BENCH_HELP, add_help=False)   # main() hands it to the benchmarks before parsing
    return parser


def run_benchmarks(argv: list[str]) -> None:
    """The benchmarks sit above ferry (they import it), so ferry names them only as a program to run: this
    process becomes `python -m benchmarks ARGV`, with the same pid, streams and exit code."""
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        run_benchmarks(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
