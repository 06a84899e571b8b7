"""`python -m scheduler`: one scheduler (and the worker it spawns) serving gRPC, registered in Redis."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

from base import event_loop
from base.cluster_auth import add_secret_args, cluster_secrets
from base.config import EngineConfig
from base.options import DefaultsHelpFormatter, add_arguments, add_log_level_argument, from_args
from base.tls import add_tls_args, tls_config
from scheduler.options import ServeOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ServeOptions)
    add_secret_args(parser)
    parser.add_argument("--insecure", action="store_true",
                        help="serve on a --host beyond loopback without a cluster token: anyone who reaches it can "
                             "submit, abort and read requests")
    add_tls_args(parser, ca_help="callers must present a certificate this CA signed (mutual TLS); needs --tls-cert")
    add_log_level_argument(parser)
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        secrets, tls = cluster_secrets(args), tls_config(args)
        tls.check()
        check_exposure(args.host, secrets.cluster_token, args.insecure)
        options = from_args(ServeOptions, args, cluster_token=secrets.cluster_token,
                            redis_password=secrets.redis_password, tls=tls)
        config = from_args(EngineConfig, args)
        config.validate()
    except ValueError as e:
        parser.error(str(e))
    if tls.ca and not tls.serving:
        parser.error("--tls-ca needs --tls-cert and --tls-key (the scheduler checks callers' certificates over TLS)")
    from scheduler.process import serve

    return event_loop.run(serve(config, options))


def check_exposure(host: str, cluster_token: str, insecure: bool) -> None:
    """ValueError when the scheduler would serve hosts other than this one without a cluster token, unasked."""
    if cluster_token or insecure or is_loopback(host):
        return
    raise ValueError(f"--host {host} takes callers from other hosts, but no cluster token is set: give the routers' "
                     "(--cluster-token, --cluster-token-file or $FERRY_CLUSTER_TOKEN), or pass --insecure to serve "
                     "any caller")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # a name other than localhost may resolve anywhere
        return False


if __name__ == "__main__":
    sys.exit(main())
