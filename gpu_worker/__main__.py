"""`python -m gpu_worker --socket PATH`: serve one Worker on a unix socket (normally spawned by its scheduler)."""
from __future__ import annotations

import argparse
import logging

from base.options import DefaultsHelpFormatter, add_log_level_argument


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--socket", required=True, help="unix socket path to listen on")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the scheduler) dies")
    add_log_level_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s worker %(levelname)s %(message)s")
    from gpu_worker.process import exit_with_parent, serve

    if args.parent_pid:
        exit_with_parent(args.parent_pid)
    serve(args.socket)


if __name__ == "__main__":
    main()
