"""ServeOptions: what `python -m scheduler` serves with besides the EngineConfig, each field the one source of its
flag (base/options.py); `ferry up` passes them on with to_argv."""
from __future__ import annotations

from dataclasses import dataclass

from base.config import DRAIN_TIMEOUT_S
from base.options import nested, no_flag, option
from base.tls import TlsConfig
from scheduler.admission import AdmissionLimits

ROLES = ("both", "prefill", "decode")


@dataclass
class ServeOptions:
    host: str = option("127.0.0.1", "address the gRPC port binds; beyond loopback it needs a cluster token or "
                                    "--insecure")
    port: int = option(0, "gRPC port; 0: any free port")
    advertise_host: str = option("", "address routers use to reach this scheduler; empty: --host, or this host's "
                                     "IP when --host is 0.0.0.0", env="FERRY_ADVERTISE_HOST")
    redis_url: str = option("", "the Redis this scheduler registers in; empty: none (routers then need "
                                "--scheduler)", env="FERRY_REDIS_URL")
    scheduler_id: str = option("", "the id it registers under; empty: <hostname>-<pid>")
    role: str = option("both", "what routers send it under disaggregated prefill and decode: prefill (compute "
                               "prompts, whose KV a decode scheduler pulls), decode (pull a prompt's KV from a "
                               "prefill scheduler, then generate), both (everything, as without disaggregation)",
                       choices=ROLES)
    heartbeat_ttl: float = option(3.0, "seconds a registration lives")
    metrics_port: int = option(0, "Prometheus /metrics port; 0: none", env="FERRY_METRICS_PORT")
    log_stats_interval: float = option(10.0, "seconds between stats lines; 0: none")
    limits: AdmissionLimits = nested(AdmissionLimits())
    drain_timeout: float = option(DRAIN_TIMEOUT_S, "on SIGTERM, seconds to finish in-flight requests before "
                                                   "failing them")
    cluster_token: str = no_flag("")      # callers of the Scheduler service must present it; "": anyone may call
    redis_password: str = no_flag("")
    tls: TlsConfig = no_flag(TlsConfig())   # cert: TLS on the gRPC port; ca too: callers need a certificate it signed
