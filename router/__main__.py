"""`python -m router`: a stateless router; finds schedulers in Redis (or takes them from --scheduler)."""
from __future__ import annotations

import argparse
import logging
import sys

from base import event_loop
from base.cluster_auth import add_secret_args, cluster_secrets
from base.options import DefaultsHelpFormatter, add_arguments, add_log_level_argument, from_args
from base.tls import add_tls_args, tls_config
from router.api_keys import add_api_key_args, api_keys, key_tenants
from router.options import RouterOptions
from router.process import serve
from router.tenants import parse_tenant_config
from router.workers import run_workers


def main() -> int:
    parser = argument_parser()
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        options = router_options(args)
    except ValueError as e:
        parser.error(str(e))
    if not options.redis_url and not options.schedulers:
        parser.error("give --redis-url or at least one --scheduler")
    if options.workers > 1:
        if options.port == 0:
            parser.error("--workers needs a fixed --port (each worker binds it)")
        return run_workers(options.workers, sys.argv[1:])
    return event_loop.run(serve(options))


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser, RouterOptions)
    add_api_key_args(parser)
    add_secret_args(parser)
    add_tls_args(parser, ca_help="CA the schedulers' certificates are checked against; turns TLS to schedulers on "
                                 "(the router presents --tls-cert to them, for mutual TLS)")
    parser.add_argument("--tls-server-name", default="",
                        help="the name schedulers' certificates carry, when it is not the address they register")
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)   # set on each of --workers
    add_log_level_argument(parser)
    return parser


def router_options(args: argparse.Namespace) -> RouterOptions:
    """RouterOptions from the parsed flags; ValueError naming the flag that is wrong."""
    secrets, tls = cluster_secrets(args), tls_config(args)
    tls.check()
    options = from_args(RouterOptions, args, api_keys=api_keys(args), key_tenants=key_tenants(args),
                     cluster_token=secrets.cluster_token,
                     redis_password=secrets.redis_password, tls=tls, reuse_port=args.reuse_port)
    parse_tenant_config(options.tenant_config)   # ValueError naming what is wrong, before serving
    return options


if __name__ == "__main__":
    sys.exit(main())
