"""`python -m scheduler`: one scheduler (and the worker it spawns) serving gRPC, registered in Redis."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from base.cluster_auth import add_secret_args, cluster_secrets
from base.config import DRAIN_TIMEOUT_S, EngineConfig
from base.tls import add_tls_args, tls_config
from scheduler.admission import AdmissionLimits


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=defaults.model, help="local HF directory; empty: the default model")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--kv-cache-memory", type=int, default=defaults.kv_cache_memory, help="bytes; 0: default")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--batching", default=defaults.batching, choices=["continuous", "static"])
    parser.add_argument("--kv-layout", default=defaults.kv_layout, choices=["paged", "contiguous"])
    parser.add_argument("--attention-backend", default=defaults.attention_backend)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--hash-seed", type=int, default=defaults.hash_seed)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        batching=args.batching, kv_layout=args.kv_layout, attention_backend=args.attention_backend,
        seed=args.seed, hash_seed=args.hash_seed)


def main() -> int:
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
    add_tls_args(parser, ca_help="callers must present a certificate this CA signed (mutual TLS); needs --tls-cert")
    parser.add_argument("--log-level", default=os.environ.get("FERRY_LOG_LEVEL", "INFO"))
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        secrets, tls = cluster_secrets(args), tls_config(args)
        tls.check()
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
    return asyncio.run(serve(engine_config(args), options))


if __name__ == "__main__":
    sys.exit(main())
