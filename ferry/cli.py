"""The `ferry` console script: each subcommand's options and code live with the part they drive."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.cli import add_bench_parser
    from ferry.generate import add_generate_parser
    from ferry.launcher import add_up_parser

    parser = argparse.ArgumentParser(prog="ferry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_up_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
