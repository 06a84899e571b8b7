"""`python -m router`: a stateless router; finds schedulers in Redis (or takes them from --scheduler)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from base import event_loop
from base.cluster_auth import add_secret_args, cluster_secrets
from base.tls import add_tls_args, tls_config
from router.api_keys import add_api_key_args, api_keys
from router.http.serve import add_http_args, http_limits
from router.http.tool_parsers import PARSERS
from router.limits import add_limit_args, key_limits
from router.policy import POLICIES
from router.retry import add_retry_args, retry_options
from router.server import RouterOptions, serve
from router.workers import run_workers


def main() -> int:
    parser = argument_parser()
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s router %(levelname)s %(message)s")
    if not args.redis_url and not args.scheduler:
        parser.error("give --redis-url or at least one --scheduler")
    try:
        options = router_options(args)
    except ValueError as e:
        parser.error(str(e))
    if args.workers > 1:
        if args.port == 0:
            parser.error("--workers needs a fixed --port (each worker binds it)")
        return run_workers(args.workers, sys.argv[1:])
    return event_loop.run(serve(options))


# flag, type, the RouterOptions field its default comes from, help
SERVING_LIMITS = [
    ("--max-concurrent-requests", int, "max_concurrent_requests",
     "streams in flight; more get RESOURCE_EXHAUSTED / HTTP 429"),
    ("--max-request-bytes", int, "max_request_bytes", "largest HTTP body (larger: 413) or gRPC message accepted"),
    ("--drain-timeout", float, "drain_timeout", "on SIGTERM, seconds in-flight streams get to finish"),
    ("--scheduler-keepalive", float, "scheduler_keepalive",
     "a scheduler silent this many seconds is pinged; still silent after as long, its streams break and resume "
     "elsewhere"),
]


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--redis-url", default=os.environ.get("FERRY_REDIS_URL", ""))
    parser.add_argument("--scheduler", action="append", default=[], metavar="HOST:PORT",
                        help="a scheduler to use when Redis is unreachable (repeatable)")
    parser.add_argument("--model-path", default="", help="tokenizer directory for --scheduler fallbacks")
    parser.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES))
    add_http_args(parser)
    add_api_key_args(parser)
    for flag, kind, field, text in SERVING_LIMITS:
        parser.add_argument(flag, type=kind, default=getattr(RouterOptions, field), help=text)
    add_limit_args(parser)
    add_retry_args(parser)
    add_secret_args(parser)
    add_tls_args(parser, ca_help="CA the schedulers' certificates are checked against; turns TLS to schedulers on "
                                 "(the router presents --tls-cert to them, for mutual TLS)")
    parser.add_argument("--tls-server-name", default="",
                        help="the name schedulers' certificates carry, when it is not the address they register")
    parser.add_argument("--workers", type=int, default=1,
                        help="router processes sharing the gRPC and HTTP ports (SO_REUSEPORT); needs fixed ports")
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)   # set on each of --workers
    parser.add_argument("--tool-call-parser", default="", choices=sorted(PARSERS),
                        help='the format "auto" tool calls are read in (default: what the chat template shows)')
    parser.add_argument("--log-level", default=os.environ.get("FERRY_LOG_LEVEL", "INFO"))
    return parser


def router_options(args: argparse.Namespace) -> RouterOptions:
    """RouterOptions from the parsed flags; ValueError naming the flag that is wrong."""
    secrets, tls = cluster_secrets(args), tls_config(args)
    tls.check()
    return RouterOptions(args.host, args.port, args.redis_url, args.scheduler, args.model_path, args.policy,
                         args.http_host, args.http_port, api_keys(args), args.max_concurrent_requests,
                         args.max_request_bytes, args.drain_timeout, retry_options(args), key_limits(args),
                         secrets.cluster_token, secrets.redis_password, tls, args.reuse_port,
                         args.tool_call_parser, http_limits=http_limits(args),
                         scheduler_keepalive=args.scheduler_keepalive)


if __name__ == "__main__":
    sys.exit(main())
