"""`python -m scheduler`: one scheduler (and the worker it spawns) serving gRPC, registered in Redis."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from base import event_loop
from base.cluster_auth import add_secret_args, cluster_secrets
from base.config import DRAIN_TIMEOUT_S, add_engine_arguments, engine_config
from base.tls import add_tls_args, tls_config
from scheduler.admission import AdmissionLimits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--advertise-host", default=os.environ.get("FERRY_ADVERTISE_HOST", ""),
                        help="address routers use to reach this scheduler (default: $FERRY_ADVERTISE_HOST; "
                             "empty: --host, or this host's IP when --host is 0.0.0.0)")
    parser.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", ""))
    parser.add_argument("--scheduler-id", default="")
    parser.add_argument("--heartbeat-ttl", type=float, default=3.0, help="seconds a registration lives")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("FERRY_METRICS_PORT", "0")),
                        help="Prometheus /metrics port (default: $FERRY_METRICS_PORT); 0: none")
    parser.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats lines; 0: none")
    parser.add_argument("--max-queued-requests", type=int, default=AdmissionLimits.max_queued_requests,
                        help="requests waiting beyond the running batch's free seats; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--max-queued-tokens", type=int, default=AdmissionLimits.max_queued_tokens,
                        help="prompt tokens waiting; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                        help="on SIGTERM, seconds to finish in-flight requests before failing them")
    add_secret_args(parser)
    parser.add_argument("--insecure", action="store_true",
                        help="serve on a --host beyond loopback without a cluster token: anyone who reaches it can "
                             "submit, abort and read requests")
    add_tls_args(parser, ca_help="callers must present a certificate this CA signed (mutual TLS); needs --tls-cert")
    parser.add_argument("--log-level", default=os.environ.get("FERRY_LOG_LEVEL", "INFO"))
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        secrets, tls = cluster_secrets(args), tls_config(args)
        tls.check()
        check_exposure(args.host, secrets.cluster_token, args.insecure)
    except ValueError as e:
        parser.error(str(e))
    if tls.ca and not tls.serving:
        parser.error("--tls-ca needs --tls-cert and --tls-key (the scheduler checks callers' certificates over TLS)")
    from scheduler.server import ServeOptions, serve

    options = ServeOptions(host=args.host, port=args.port, advertise_host=args.advertise_host,
                           redis_url=args.redis_url, scheduler_id=args.scheduler_id,
                           heartbeat_ttl=args.heartbeat_ttl, metrics_port=args.metrics_port,
                           log_stats_interval=args.log_stats_interval, drain_timeout=args.drain_timeout,
                           limits=AdmissionLimits(args.max_queued_requests, args.max_queued_tokens),
                           cluster_token=secrets.cluster_token, redis_password=secrets.redis_password, tls=tls)
    return event_loop.run(serve(engine_config(args), options))


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
